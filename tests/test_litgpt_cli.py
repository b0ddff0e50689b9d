"""``python -m lightning_lowmem.litgpt <command>``: LitGPT's own finetune scripts, converted at the first training
forward, the loss through the fused head; per-step losses equal ``litgpt <command>``'s with the same arguments on a
tiny checkpoint made on the spot (random weights, a tokenizer trained on the standard library)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

litgpt = pytest.importorskip("litgpt")
pytest.importorskip("tokenizers")
from examples.litgpt_checkpoint import make_checkpoint
from examples.stdlib_data import docstring_samples
from lightning_lowmem.litgpt import finetune, head
from lightning_lowmem.litgpt.__main__ import ENVIRONMENT, main, split_options
from lightning_lowmem.memory import SavedTensorMeter

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny LLaMA checkpoint (4 layers x 64: LLaMA-Adapter adapts the last 2; vocabulary 1,024 padded to 4,096)
    and 64 instruction samples."""
    directory = tmp_path_factory.mktemp("litgpt")
    make_checkpoint(directory / "tiny")
    data = directory / "docstrings.json"
    data.write_text(json.dumps(docstring_samples(64)))
    return directory / "tiny", data


def arguments(checkpoint: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    """LitGPT finetune arguments: 3 SGD steps of 2 micro-batches of 2, fp32, prompts masked, no dropout. SGD, not
    LitGPT's AdamW: Adam turns last-bit gradient differences into whole updates where a gradient is near zero (its
    step is about ``lr`` whatever the gradient's size), so after 2 AdamW steps the losses differ by ~1e-5."""
    model, data = checkpoint
    return [
        str(model), "--data", "JSON", "--data.json_path", str(data), "--data.val_split_fraction", "0.1",
        "--data.mask_prompt", "true", "--train.max_steps", "3", "--train.global_batch_size", "4",
        "--train.micro_batch_size", "2", "--train.epochs", "1", "--train.lr_warmup_steps", "1",
        "--train.max_seq_length", "192", "--precision", "32-true", "--eval.interval", "1000",
        "--eval.initial_validation", "false", "--eval.final_validation", "true", "--eval.max_iters", "2",
        "--optimizer", "SGD", "--logger_name", "csv", "--out_dir", str(out), *extra,
    ]  # fmt: skip


def logged(out: Path) -> tuple[list[float], list[float]]:
    """Per-iteration training losses and the final validation loss from LitGPT's CSV log."""
    rows = list(csv.DictReader((out / "logs" / "csv" / "version_0" / "metrics.csv").open()))
    return [float(r["loss"]) for r in rows if r.get("loss")], [float(r["val_loss"]) for r in rows if r.get("val_loss")]


def lowmem(monkeypatch, command: str, args: list[str]) -> None:
    """``python -m lightning_lowmem.litgpt command args`` in this process (the script's names, ``sys.argv`` and the
    environment put back after)."""
    module = finetune.script(command)
    monkeypatch.setattr(module, "GPT", module.GPT)
    monkeypatch.setattr(module, "chunked_cross_entropy", module.chunked_cross_entropy)
    monkeypatch.setattr(sys, "argv", ["lowmem-litgpt", command, *args])
    monkeypatch.delenv(ENVIRONMENT, raising=False)
    main()


def stock(monkeypatch, command: str, args: list[str]) -> None:
    """``litgpt command args`` as LitGPT's own command line parses them, in this process."""
    from jsonargparse import CLI
    from litgpt.__main__ import PARSER_DATA

    monkeypatch.setattr(sys, "argv", ["litgpt", command, *args])  # LitGPT reads it again for its hyperparameters
    CLI({command: PARSER_DATA[command]}, args=[command, *args])


def test_finetune_lora_has_the_litgpt_commands_losses_and_converts(checkpoint, tmp_path, capsys):
    """Against the real ``litgpt finetune_lora`` (a separate process): LoRA on every linear layer, the head too."""
    extra = ["--lora_key", "true", "--lora_projection", "true", "--lora_mlp", "true", "--lora_head", "true"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "litgpt", "finetune_lora", *arguments(checkpoint, tmp_path / "stock", *extra)],
        check=False, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run(
        [sys.executable, "-m", "lightning_lowmem.litgpt", "finetune_lora",
         *arguments(checkpoint, tmp_path / "lowmem", *extra)],
        check=False, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (losses, val), (stock_losses, stock_val) = logged(tmp_path / "lowmem"), logged(tmp_path / "stock")
    assert len(losses) == 6 and len(val) == 1
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(stock_losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(val), torch.tensor(stock_val), rtol=1e-5, atol=1e-6)  # eval: stock path
    report = done.stdout[done.stdout.index("lightning_lowmem.litgpt: model surgery") :]
    assert report.count("model surgery") == 1
    assert "| head " in report and "chunked_cross_entropy through the fused linear + cross-entropy" in report
    assert "21 LoRAs converted" in report and "9 norms converted" in report


def test_two_devices_convert_on_both_ranks_and_keep_litgpts_losses(checkpoint, tmp_path):
    """``--devices 2`` (LitGPT's ModelParallelStrategy: FSDP2 over each block, then the root, on CPU with gloo): the
    model converts on rank 0's batch with the options given, the head FSDP2 shards with the root is fused (gathered for
    the loss's forward and backward), and the losses are ``litgpt finetune_lora``'s."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    runs = {}
    for name, command in (("stock", ["litgpt"]), ("lowmem", ["lightning_lowmem.litgpt", "--lowmem.gated", "false"])):
        args = [*arguments(checkpoint, tmp_path / name), "--devices", "2", "--eval.final_validation", "false"]
        done = subprocess.run(
            [sys.executable, "-m", command[0], "finetune_lora", *args, *command[1:]],
            check=False, capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = done.stdout
    torch.testing.assert_close(
        torch.tensor(logged(tmp_path / "lowmem")[0]), torch.tensor(logged(tmp_path / "stock")[0]), rtol=1e-5, atol=1e-6
    )
    report = runs["lowmem"]
    assert report.count("model surgery") == 1 and "gated MLP" not in report.split("model surgery")[1].split("Epoch")[0]
    assert "chunked_cross_entropy through the fused linear + cross-entropy" in report and "norms converted" in report


@pytest.mark.parametrize(
    ("command", "fate"),
    [
        ("finetune_full", "head converted"),
        ("finetune_adapter", "head converted"),
        ("finetune_adapter_v2", "its head is a AdapterV2Linear, not a linear layer"),
    ],
)
def test_the_other_finetune_commands_have_stocks_losses(checkpoint, tmp_path, monkeypatch, capsys, command, fate):
    """Full fine-tuning (the head trains through the fused loss), LLaMA-Adapter; LLaMA-Adapter v2's head (a scale
    and a bias per logit) keeps LitGPT's logits, with why."""
    stock(monkeypatch, command, arguments(checkpoint, tmp_path / "stock"))
    lowmem(monkeypatch, command, arguments(checkpoint, tmp_path / "lowmem"))
    (losses, val), (stock_losses, stock_val) = logged(tmp_path / "lowmem"), logged(tmp_path / "stock")
    assert len(losses) == 6
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(stock_losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(val), torch.tensor(stock_val), rtol=1e-5, atol=1e-6)
    out = capsys.readouterr().out
    assert fate in out and "norms converted" in out


def test_lowmem_options_reach_the_surgery(checkpoint, tmp_path, monkeypatch, capsys):
    lowmem(monkeypatch, "finetune_lora", [*arguments(checkpoint, tmp_path), "--lowmem.head", "false",
                                          "--lowmem.gated=false"])  # fmt: skip
    out = capsys.readouterr().out
    assert "head=False: LitGPT's logits" in out and "gated MLP" not in out.split("model surgery")[1].split("Epoch")[0]
    assert split_options(["--lowmem.budget-mib", "2048", "x"]) == ({"budget_mib": 2048}, ["x"])
    with pytest.raises(TypeError, match="unknown option 'bit'"):
        main(["finetune_lora", "--lowmem.bit", "2"])
    assert json.loads(os.environ[ENVIRONMENT]) == {"head": False, "gated": False}  # for the ranks Fabric starts


def test_unknown_commands_and_unsupported_litgpt_versions_fail_clearly(monkeypatch):
    with pytest.raises(SystemExit, match="unknown command 'pretrain'; one of finetune, finetune_lora"):
        finetune.script("pretrain")
    monkeypatch.setattr(finetune, "version", lambda name: "0.6.0")
    with pytest.raises(RuntimeError, match=r"LitGPT 0.6.0 is not supported \(supported: <0.6,>=0.5.13\)"):
        main(["finetune_lora", "x"])


def head_bytes(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor, loss_of) -> tuple[int, torch.Tensor]:
    """Bytes saved for backward by the head and the loss (LitGPT's training step: chunks of 128 positions, the last
    position dropped), and the loss."""
    with SavedTensorMeter(model) as meter:
        logits = model(ids, lm_head_chunk_size=128)
        logits[-1] = logits[-1][..., :-1, :]
        loss = loss_of(logits, targets[..., 1:])
    by_module = meter.by_module
    return sum(by_module.get(name, 0) for name in ("lm_head", "lm_head.linear", "<outside>")), loss


def test_the_fused_head_saves_under_2_percent_of_litgpts_and_its_errors_are_clear(checkpoint):
    """The tiny checkpoint's head (64 features, 4,096 padded vocabulary rows), LoRA on it, bytes per token (the
    growth from 2 x 128 to 2 x 256 tokens; what does not grow is the LoRA B's gradient, one weight): LitGPT keeps
    each chunk's fp32 log-probabilities (4,096 x 4 B a token); the fused head the hidden states' gradient and the
    LoRA A output's (68 x 4 B): 1.7%, about the ratio of features to vocabulary (Llama-3-8B's 4,096 / 128,256: 3.2%)."""
    import litgpt.lora
    from litgpt.utils import chunked_cross_entropy

    config = litgpt.lora.Config.from_file(checkpoint[0] / "model_config.yaml", lora_r=4, lora_alpha=8, lora_head=True)
    torch.manual_seed(0)
    model = litgpt.lora.GPT(config).train()
    litgpt.lora.mark_only_lora_as_trainable(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    targets = ids.clone()
    targets[0, :100] = -100
    stock_bytes, stock_loss = head_bytes(model, ids, targets, chunked_cross_entropy)
    stock_loss.backward()
    stock_grads = [p.grad.clone() for p in trained]
    model.zero_grad()
    stock_per_token = (stock_bytes - head_bytes(model, ids[:, :128], targets[:, :128], chunked_cross_entropy)[0]) / 256
    fused = head.FusedLossHead(model)
    model.forward = lambda *a, **k: fused.forward(type(model).forward.__get__(model), *a, **k)
    ours_bytes, loss = head_bytes(model, ids, targets, head.chunked_cross_entropy)
    loss.backward()
    torch.testing.assert_close(loss, stock_loss, rtol=1e-6, atol=1e-6)
    for p, expected in zip(trained, stock_grads):
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-7)
    per_token = (ours_bytes - head_bytes(model, ids[:, :128], targets[:, :128], head.chunked_cross_entropy)[0]) / 256
    assert stock_per_token >= 4096 * 4 and per_token == (64 + 4) * 4 and per_token <= 0.02 * stock_per_token
    with pytest.raises(TypeError, match=r"only LitGPT's logits\[..., :-1, :\]"):
        model(ids)[:, -1]
    with pytest.raises(ValueError, match="255 positions of logits"):
        head.chunked_cross_entropy(model(ids)[..., :-1, :], targets)
    with torch.no_grad():
        assert model(ids).shape == (2, 256, config.padded_vocab_size)  # no gradients: LitGPT's logits
