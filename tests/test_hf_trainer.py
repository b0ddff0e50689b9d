"""Hugging Face's Trainer with ``LowMemCallback``: the model converts at its first training step, on the collated
batch (labels, packed sequences' position_ids, a completion-only micro-batch whose labels are all -100), under
gradient accumulation with ``num_items_in_batch``, and trains with stock's per-step losses."""

from __future__ import annotations

import pytest
import torch

from benchmarks import zoo
from lightning_lowmem.nn.causal_lm import fused_loss_of
from lightning_lowmem.surgery.convert import Surgery

transformers = pytest.importorskip("transformers")
from lightning_lowmem.hf import LowMemCallback

STEPS, BATCH, ACCUMULATION = 5, 2, 2


class Samples(torch.utils.data.Dataset):
    """Rows of 16 tokens, each two packed sequences (``position_ids`` restart at 10), a 4-token prompt not trained on;
    rows 2 and 3 (the second micro-batch) are completion-only samples whose answer was truncated away."""

    def __init__(self, rows: int = STEPS * BATCH * ACCUMULATION) -> None:
        self.ids = torch.randint(3, zoo.VOCAB, (rows, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[: 16 if i in (2, 3) else 4] = -100
        position_ids = torch.cat([torch.arange(10), torch.arange(6)])
        return {"input_ids": self.ids[i], "labels": labels, "position_ids": position_ids}


def train(tmp_path, callbacks: list, **arguments) -> tuple[list[float], torch.nn.Module]:
    """Per-step losses of a LoRA fine-tune of the tiny LLaMA (r 4 on every linear, dropout 0, fp32)."""
    torch.manual_seed(0)
    model = zoo.lora(zoo.llama(), zoo.LLAMA_LINEARS, random_b=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS, learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        seed=0, disable_tqdm=True, **arguments,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Samples(), callbacks=callbacks)
    trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log], model


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "gradient_checkpointing"])
def test_the_trainer_converts_at_its_first_step_and_trains_with_stocks_losses(tmp_path, checkpointing, capsys):
    callback = LowMemCallback()
    stock_losses, _ = train(tmp_path / "stock", [], gradient_checkpointing=checkpointing)
    losses, model = train(tmp_path / "lowmem", [callback], gradient_checkpointing=checkpointing)
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(stock_losses), rtol=1e-5, atol=1e-6)
    report = callback.report
    assert not report.pending and report.reduction > 0
    kinds = {e.kind for e in report.converted}
    assert {"gated MLP", "norm", "head"} <= kinds
    assert fused_loss_of(model.base_model.model) is not None  # the loss through the fused head: no logits kept
    assert "position_ids=tensor[2, 16]" in report.probe and "labels=tensor[2, 16]" in report.probe
    assert capsys.readouterr().out.count("LowMemCallback: model surgery") == 1


def test_options_reach_the_surgery_and_bad_ones_are_refused(tmp_path):
    callback = LowMemCallback(head=False, gated=False)
    train(tmp_path, [callback])
    kinds = {e.kind for e in callback.report.converted}
    assert "head" not in kinds and "gated MLP" not in kinds and "norm" in kinds
    with pytest.raises(TypeError, match="LowMemCallback: unknown option 'bit'"):
        LowMemCallback(bit=2)


def test_trls_sft_trainer_keeps_its_own_fused_head_and_trains_with_the_rest_converted(tmp_path):
    """TRL's SFTTrainer (1.16) patches the model's forward with its own fused LM head (``fused_lm_head=True``): the
    head is left alone with why (and TRL's patch stays), the norms and gated MLPs convert, and the run's losses are
    stock's to rounding (the exact ops' last-bit differences, grown by 5 Adam steps at lr 1e-2: ~5e-5)."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel

    words = tokenizers.Tokenizer(WordLevel({f"t{i}": i for i in range(zoo.VOCAB)}, unk_token="t3"))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3"
    )
    samples = Samples()
    rows = [{"input_ids": samples[i]["input_ids"].tolist(), "labels": samples[i]["labels"].tolist()} for i in range(20)]

    def run(callbacks: list) -> tuple[list[float], torch.nn.Module]:
        torch.manual_seed(0)
        model = zoo.lora(zoo.llama(), zoo.LLAMA_LINEARS, random_b=True)
        args = trl.SFTConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATION,
            max_steps=STEPS, learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
            seed=0, disable_tqdm=True, dataset_kwargs={"skip_prepare_dataset": True}, max_length=None,
        )  # fmt: skip
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                 processing_class=tokenizer, callbacks=callbacks)  # fmt: skip
        trainer.train()
        return [log["loss"] for log in trainer.state.log_history if "loss" in log], model

    callback = LowMemCallback()
    stock_losses, _ = run([])
    losses, model = run([callback])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(stock_losses), rtol=1e-3, atol=0)
    head = next(e for e in callback.report.entries if e.kind == "head")
    assert head.status == "left alone" and "patched by another library" in head.detail
    assert "forward" in model.base_model.model.__dict__ and fused_loss_of(model.base_model.model) is None
    assert {"gated MLP", "norm"} <= {e.kind for e in callback.report.converted}


def test_a_rollback_puts_back_another_librarys_patched_forward():
    model = zoo.llama()
    ids = zoo.tokens()
    patched = model.forward  # a bound method held by the instance, as TRL's and accelerate's patches are
    model.forward = patched
    surgery = Surgery(model)
    surgery.override(model, "forward", lambda *a, **k: None)
    surgery.rollback()
    assert model.__dict__["forward"] is patched and model(input_ids=ids).logits is not None
