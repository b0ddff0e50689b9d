"""Hugging Face causal LMs compute their training loss through the fused head: no logits, stock's loss."""

from __future__ import annotations

import copy
import pickle

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import zoo
from lightning_lowmem import LowMemBP, apply_lowmem, max_batch_size, plan
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.nn.causal_lm import fused_loss_of

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

QWEN2_VOCAB, LLAMA2_VOCAB = 151_936, 32_000


def qwen2_lora(vocab: int = QWEN2_VOCAB) -> torch.nn.Module:
    """Qwen2 (by default its vocabulary) on a tiny body (hidden 64, 2 layers), peft LoRA on every linear of the body."""
    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return zoo.lora(transformers.Qwen2ForCausalLM(config), zoo.LLAMA_LINEARS, random_b=True)


def batch(vocab: int, rows: int = 2, tokens: int = 16) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, tokens))
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that is not trained on
    return {"input_ids": ids, "labels": labels}


def step(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, int, dict[str, torch.Tensor], object]:
    """One training step: the loss, the bytes saved for backward, the gradients, the output."""
    model.train()
    model.zero_grad(set_to_none=True)
    with SavedTensorMeter(model) as meter:
        output = model(**inputs)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.loss.detach(), meter.total_bytes, grads, output


def assert_same_step(stock_step, fused_step, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(fused_step[0], stock_step[0], rtol=rtol, atol=0)
    assert fused_step[2].keys() == stock_step[2].keys()
    for name, grad in stock_step[2].items():
        torch.testing.assert_close(fused_step[2][name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item())


def test_a_qwen2_vocabulary_lora_step_saves_the_logits_with_the_same_loss_and_gradients():
    stock = qwen2_lora()
    model = copy.deepcopy(stock)
    inputs = batch(QWEN2_VOCAB)
    report = apply_lowmem(model, example_input=inputs)
    head = [e for e in report.entries if e.kind == "head"]
    assert [(e.name, e.status) for e in head] == [("base_model.model", "converted")]
    stock_step, fused_step = step(stock, inputs), step(model, inputs)
    assert_same_step(stock_step, fused_step)
    tokens = inputs["input_ids"].numel()
    assert stock_step[1] - fused_step[1] >= tokens * QWEN2_VOCAB * 4
    assert fused_step[3].logits is None and stock_step[3].logits is not None


@pytest.mark.parametrize(
    "family",
    ["LlamaForCausalLM", "Gemma2ForCausalLM", "GPT2LMHeadModel", "Phi3ForCausalLM", "FalconForCausalLM"],
)
def test_every_family_keeps_its_own_loss(family):
    """Softcapping (Gemma 2's final_logit_softcapping), tied embeddings (GPT-2, Gemma), biases and shapes."""
    stock = zoo.FAMILIES[family].build()
    if family == "Gemma2ForCausalLM":
        assert stock.config.final_logit_softcapping
    model = copy.deepcopy(stock)
    inputs = batch(zoo.VOCAB)
    # unmeasured: at the zoo's vocabulary of 128 (2x its hidden size) the fused head alone saves no less than
    # stock's logits, which the never-worse rule would roll back; the loss's semantics are what is tested here
    report = apply_lowmem(model, example_input=inputs, activation=False, norm=False, gated=False, measure=False)
    assert [e.status for e in report.entries if e.kind == "head"] == ["converted"] and fused_loss_of(model)
    assert_same_step(step(stock, inputs), step(model, inputs))


def test_num_items_in_batch_and_shift_labels_are_the_stock_losss():
    stock = zoo.llama()
    model = copy.deepcopy(stock)
    inputs = batch(zoo.VOCAB)
    apply_lowmem(model, example_input=inputs)
    for extra in ({"num_items_in_batch": torch.tensor(17)}, {"shift_labels": inputs["labels"].roll(1, -1)}):
        assert_same_step(step(stock, inputs | extra), step(model, inputs | extra))


def test_evaluation_generation_and_calls_without_labels_are_stock():
    stock = zoo.llama()
    model = copy.deepcopy(stock)
    inputs = batch(zoo.VOCAB)
    apply_lowmem(model, example_input=inputs)
    model.train()
    no_labels = model(input_ids=inputs["input_ids"]).logits
    torch.testing.assert_close(no_labels, stock.train()(input_ids=inputs["input_ids"]).logits, rtol=1e-4, atol=1e-5)
    as_tuple = model(**inputs, return_dict=False)
    assert as_tuple[1].shape[-1] == zoo.VOCAB  # the stock forward, logits and all
    model.eval()
    with torch.no_grad():
        evaluated = model(**inputs)
        assert evaluated.logits is not None and torch.isfinite(evaluated.loss)
        generated = model.generate(inputs["input_ids"][:1, :4], max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 7)


def test_head_off_keeps_the_logits_and_a_dora_adapted_head_is_left_alone_with_why():
    model = zoo.llama()
    apply_lowmem(model, example_input=batch(zoo.VOCAB), head=False)
    assert fused_loss_of(model) is None and model.train()(**batch(zoo.VOCAB)).logits is not None
    adapted = zoo.lora(zoo.llama(), ["q_proj", "lm_head"], use_dora=True)
    report = apply_lowmem(adapted, example_input=batch(zoo.VOCAB))
    (entry,) = [e for e in report.entries if e.kind == "head"]
    assert entry.status == "left alone" and "DoRA" in entry.detail


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_a_lora_adapted_head_is_fused_with_peft_semantics(dropout):
    """LoRA on every linear, the head included: peft's loss and gradients, no logits; disabling the adapters
    afterwards falls back to the base weight, as peft does."""
    stock = zoo.lora(zoo.llama(), [*zoo.LLAMA_LINEARS, "lm_head"], random_b=True, lora_dropout=dropout)
    model = copy.deepcopy(stock)
    inputs = batch(zoo.VOCAB)
    report = apply_lowmem(model, example_input=inputs, dropout=False)
    assert [e.status for e in report.entries if e.kind == "head"] == ["converted"]
    torch.manual_seed(1)
    stock_step = step(stock, inputs)
    torch.manual_seed(1)
    fused_step = step(model, inputs)
    assert any("lm_head.lora_B" in name for name in fused_step[2])
    assert_same_step(stock_step, fused_step)  # with dropout: peft's, drawing the same masks in the same order
    assert fused_step[3].logits is None
    with model.disable_adapter(), stock.disable_adapter():
        torch.testing.assert_close(model(**inputs).loss, stock(**inputs).loss, rtol=1e-5, atol=0)


def test_a_converted_model_pickles_converts_once_and_rolls_back():
    model = zoo.llama()
    inputs = batch(zoo.VOCAB, tokens=64)  # enough rows that the fused head saves (its weight-sized sums: 32 KiB)
    apply_lowmem(model, example_input=inputs)
    twin = pickle.loads(pickle.dumps(model))
    assert fused_loss_of(twin) is not None and fused_loss_of(twin).model is twin
    assert_same_step(step(model, inputs), step(twin, inputs))
    again = apply_lowmem(model, example_input=inputs)
    assert [e.status for e in again.entries if e.kind == "head"] == ["already converted"]
    planned = zoo.llama()
    plan(planned, inputs)  # converts, measures, rolls back
    assert fused_loss_of(planned) is None and "forward" not in planned.__dict__


class CausalLM(pl.LightningModule):
    """As users write it: a peft LLaMA, ``training_step`` returns ``model(**batch).loss``, no example input."""

    def __init__(self) -> None:
        super().__init__()
        self.model = zoo.lora(zoo.llama(), zoo.LLAMA_LINEARS)

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return self.model(input_ids=ids, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_lowmem_bp_fuses_the_loss_of_a_peft_causal_lm_with_no_change(tmp_path):
    ids = torch.randint(0, zoo.VOCAB, (8, 16))
    loader = DataLoader(TensorDataset(ids, ids.clone()), batch_size=2)
    callback = LowMemBP()
    module = CausalLM()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[callback], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, loader)
    assert trainer.global_step == 2
    assert [e.status for e in callback.report.entries if e.kind == "head"] == ["converted"]
    assert fused_loss_of(module.model.base_model.model) is not None


def test_max_batch_size_counts_the_fused_head():
    """LLaMA-2's vocabulary on a tiny body: the logits are nearly all of a row's activations, so the batch that fits
    a budget is many times larger with the fused head than with ``head=False``."""
    model, inputs = qwen2_lora(vocab=LLAMA2_VOCAB), batch(LLAMA2_VOCAB)
    fused, stock_head = (max_batch_size(model, inputs, 16, head=head) for head in ("auto", False))
    assert stock_head >= 1 and fused >= 4 * stock_head, (fused, stock_head)
    assert fused_loss_of(model) is None  # left unchanged


def test_a_head_that_costs_is_rolled_back_alone():
    """Full fine-tuning on 4 tokens at a vocabulary of 2x the hidden size: the fused head holds its weight's gradient
    (vocabulary x hidden) where stock holds 4 tokens' logits, so it costs; it alone is rolled back, the gated MLPs and
    norms stay, and the step is stock's."""
    stock = zoo.llama()
    model = copy.deepcopy(stock)
    inputs = batch(zoo.VOCAB, rows=1, tokens=4)
    report = apply_lowmem(model, example_input=inputs)
    head = next(e for e in report.entries if e.kind == "head")
    assert head.status == "left alone" and "with the head conversions" in head.detail and "without them" in head.detail
    assert fused_loss_of(model) is None and "forward" not in model.lm_head.__dict__
    kept = {e.kind for e in report.converted}
    assert {"gated MLP", "norm"} <= kept and report.saved_bytes_after < report.saved_bytes_before
    assert any(type(m).__name__ == "MSRMSNorm" for m in model.modules())
    assert_same_step(step(stock, inputs), step(model, inputs))


def test_a_head_that_costs_is_rolled_back_where_the_model_saves_overall():
    """Never worse, kind by kind: a LLaMA whose vocabulary (128) is below its hidden size (256) saves far less than
    stock converted, but its fused head saves more than stock's logits would: the head alone is rolled back, with
    the reason, and the model keeps what it keeps with ``head=False``."""
    torch.manual_seed(0)
    stock = zoo.llama(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4)
    inputs = batch(zoo.VOCAB, rows=2, tokens=64)
    report = apply_lowmem(copy.deepcopy(stock), example_input=inputs)
    without_head = apply_lowmem(copy.deepcopy(stock), example_input=inputs, head=False)
    head = next(e for e in report.entries if e.kind == "head")
    assert head.status == "left alone" and "with the head conversions" in head.detail, head.detail
    assert report.saved_bytes_after == without_head.saved_bytes_after < report.saved_bytes_before
    assert {"gated MLP", "norm"} <= {e.kind for e in report.converted}


def test_a_fully_masked_micro_batch_leaves_the_accumulated_gradients_stocks():
    """Gradient accumulation over two micro-batches, the second with every label -100 (a completion-only sample
    whose answer was truncated away), no num_items_in_batch: its loss is NaN as stock's, its gradients zero, so
    the accumulated gradients are the first micro-batch's, finite, as stock's (they were NaN in all parameters)."""
    stock = zoo.llama()
    model = copy.deepcopy(stock)
    first, masked = batch(zoo.VOCAB, tokens=64), batch(zoo.VOCAB, tokens=64)
    masked["labels"][:] = -100
    apply_lowmem(model, example_input=first)
    assert fused_loss_of(model) is not None
    losses = {}
    for name, m in (("stock", stock), ("ours", model)):
        m.train()
        m.zero_grad(set_to_none=True)
        for micro in (first, masked):
            loss = m(**micro).loss / 2
            loss.backward()
        losses[name] = loss.detach()
    assert losses["ours"].isnan() and losses["stock"].isnan()
    for name, p in stock.named_parameters():
        got = model.get_parameter(name).grad
        assert got.isfinite().all(), name
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("family", ["LlamaForCausalLM", "Phi3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM"])
def test_o_proj_reads_the_attention_output_sdpa_saves_with_no_copy(family, monkeypatch):
    """Hugging Face's attention hands ``o_proj`` ``attn_output.transpose(1, 2).contiguous()`` of SDPA's output: a copy
    that ``o_proj``'s LoRA adapter saves beside SDPA's own where SDPA's query (and so its output) is
    ``(B, H, T, D)``-contiguous (Phi-3's partial RoPE). Converted (``lowmem_sdpa``), ``o_proj`` reads, and saves,
    SDPA's very storage in every family on SDPA, with the same loss and gradients; a rollback puts ``sdpa`` back."""
    torch.manual_seed(0)
    stock = zoo.lora(zoo.FAMILIES[family].build(), ["o_proj"])
    if stock.config._attn_implementation != "sdpa":
        pytest.skip(f"{family} attends with {stock.config._attn_implementation}")
    model = copy.deepcopy(stock)
    inputs = batch(model.config.vocab_size, tokens=32)
    report = apply_lowmem(model, example_input=inputs)
    assert model.config._attn_implementation == "lowmem_sdpa"
    assert any(e.kind == "attention" and "o_proj reads the output SDPA saves" in e.detail for e in report.converted)
    outputs, read = [], []
    stock_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: outputs.append(stock_sdpa(*a, **k)) or outputs[-1],
    )
    o_proj = next(m for name, m in model.named_modules() if name.endswith("layers.0.self_attn.o_proj"))
    o_proj.register_forward_pre_hook(lambda module, args: read.append(args[0]))
    model.train()(**inputs)
    assert read and read[0].untyped_storage().data_ptr() == outputs[0].untyped_storage().data_ptr()
    monkeypatch.undo()
    assert_same_step(step(stock, inputs), step(model, inputs))
    planned = copy.deepcopy(stock)
    plan(planned, inputs)  # converts, measures, rolls back
    assert planned.config._attn_implementation == "sdpa"
