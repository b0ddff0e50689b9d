"""The examples run: every yaml config under LightningCLI, and the README's main job, shortened."""

from __future__ import annotations

import io
import json
import logging
import math
import re
import statistics
from pathlib import Path

import pytest
import torch

for _package in ("timm", "transformers", "peft", "sklearn", "matplotlib", "jsonargparse"):  # the examples extra
    pytest.importorskip(_package)

from examples import compare, llama_finetune, stdlib_data, vit_finetune
from lightning_lowmem import kernels

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "examples" / "configs").glob("*.yaml"))
SCRIPTS = {"vit": vit_finetune, "llama": llama_finetune}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_config_runs_under_lightning_cli(config, tmp_path):
    script = SCRIPTS[config.stem.split("_")[0]]
    model_class, data_class = (
        (vit_finetune.ViTFineTuner, vit_finetune.DigitsDataModule)
        if script is vit_finetune
        else (llama_finetune.LlamaLoRA, llama_finetune.StdlibTextDataModule)
    )
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(
        model_class, data_class,
        args=["fit", "--config", str(config), "--trainer.fast_dev_run=1", "--data.batch_size=4",
              f"--trainer.default_root_dir={tmp_path}"],
        save_config_kwargs={"overwrite": True},
    )  # fmt: skip
    assert cli.trainer.state.finished
    uses_lowmem = "lowmem" in config.stem
    converted = [m for m in cli.model.modules() if type(m).__module__.startswith("lightning_lowmem")]
    assert bool(converted) == uses_lowmem


def test_the_llama_example_prints_the_heads_share_before_and_after(tmp_path, caplog):
    from lightning.pytorch.cli import LightningCLI

    config = CONFIGS[0].with_name("llama_lora_lowmem.yaml")
    with caplog.at_level(logging.INFO):
        cli = LightningCLI(
            llama_finetune.LlamaLoRA, llama_finetune.StdlibTextDataModule,
            args=["fit", "--config", str(config), "--trainer.fast_dev_run=1", "--data.batch_size=4",
                  f"--trainer.default_root_dir={tmp_path}"],
            save_config_kwargs={"overwrite": True},
        )  # fmt: skip
    line = next(r.getMessage() for r in caplog.records if "language-model head and loss" in r.getMessage())
    before, after = (float(mib) for mib in re.findall(r"([\d.]+) of [\d.]+ MiB", line))
    config = cli.model.model.get_base_model().config  # stock keeps fp32 logits, the fused head the input's gradient
    assert after <= 1.05 * before * config.hidden_size / config.vocab_size < before, line


def test_method_switches_on_from_the_command_line(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = CONFIGS[0].with_name("vit_lora_baseline.yaml")
    cli = LightningCLI(
        vit_finetune.ViTFineTuner, vit_finetune.DigitsDataModule,
        args=["fit", "--config", str(config), "--trainer.fast_dev_run=1", f"--trainer.default_root_dir={tmp_path}",
              "--trainer.callbacks+=lightning_lowmem.LowMemBP"],
    )  # fmt: skip
    assert any(type(m).__name__ == "ReGELU2" for m in cli.model.modules())


def test_main_job_prints_and_draws_the_comparison(capsys, tmp_path):
    runs = compare.main(["--epochs", "2", "--limit-batches", "3", "--batch-size", "4", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "compare.json").read_text())
    assert summary["runs"] == runs
    base, low = runs["baseline"], runs["lowmem"]
    assert low["activation_mib"][-1] < 0.8 * base["activation_mib"][-1]
    assert all(math.isfinite(loss) for loss in base["val_loss"] + low["val_loss"])

    # the header says what ran where; accuracy and loss change as differences, step time as median and IQR
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert summary["kernels"] == kernels.backend(device)
    assert f"{summary['device']}, lightning-lowmem kernels: {summary['kernels']}" in out
    acc = [100 * run["val_acc"][-1] for run in (base, low)]
    figures = (re.escape(f"{value:{spec}}") for value, spec in zip((*acc, acc[1] - acc[0]), (".1f", ".1f", "+.1f")))
    assert re.search(r"val acc %\s+{}\s+{}\s+{} pts".format(*figures), out)
    assert re.search(r"val loss\s+\S+\s+\S+\s+[+-]\d\.\d{3}\n", out)
    assert re.search(r"step ms, median\s+[\d.]+\s+[\d.]+\s+[+-][\d.]+%\nstep ms, IQR\s+[\d.]+-[\d.]+\s", out)
    # and the trained models' steps timed in alternation, 30 each
    assert len(base["alternated_step_ms"]) == len(low["alternated_step_ms"]) == 30
    alternated = [statistics.median(run["alternated_step_ms"]) for run in (base, low)]
    change = 100 * (alternated[1] / alternated[0] - 1)
    cells = (f"{alternated[0]:.1f}", f"{alternated[1]:.1f}", f"{change:+.1f}%")
    assert re.search(r"step ms, alternated\s+" + r"\s+".join(map(re.escape, cells)), out)
    assert "Activation memory saved by lightning-lowmem" in out

    figure = compare.figure(summary)
    buffer = io.BytesIO()
    figure.savefig(buffer, dpi=100)
    assert (tmp_path / "compare.png").read_bytes() == buffer.getvalue()  # the picture is the JSON, drawn
    memory, step, accuracy = figure.axes
    assert [ax.get_title() for ax in figure.axes] == [
        "Activations (saved for backward)", "Step time (median, quartiles)", "Validation accuracy"
    ]  # fmt: skip
    for ax, key, scale in ((memory, "activation_mib", 1), (accuracy, "val_acc", 100)):
        lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
        assert lines == {name: [scale * v for v in runs[name][key]] for name in ("baseline", "lowmem")}
        assert [tick for tick in ax.get_xticks() if ax.get_xlim()[0] <= tick <= ax.get_xlim()[1]] == [0, 1]
    saved = 100 * (1 - low["activation_mib"][-1] / base["activation_mib"][-1])
    assert memory.texts[0].get_text() == f"lowmem saves {saved:.1f}%"
    assert [tick.get_text() for tick in step.get_xticklabels()] == ["baseline", "lowmem"]
    flat = {line.get_ydata()[0] for line in step.get_lines() if len(set(line.get_ydata())) == 1}
    assert {statistics.median(run["step_ms"]) for run in (base, low)} <= flat  # the median bars
    assert summary["kernels"] in figure.get_suptitle()


def test_stdlib_text_is_real_python_source():
    text = stdlib_data.stdlib_text(20_000)
    assert len(text) == 20_000 and b"def " in text and b"import " in text


SMOKE = ["--steps", "3", "--n-layer", "2", "--n-embd", "64", "--seq-len", "32", "--accelerator", "cpu"]


def test_the_litgpt_fabric_example_fine_tunes_with_less_memory(capsys):
    pytest.importorskip("litgpt")
    from examples import litgpt_finetune

    result = litgpt_finetune.main(SMOKE)
    out = capsys.readouterr().out
    assert result["reduction"] > 0.5 and math.isfinite(result["last_loss"]), out
    assert "less activation memory than stock" in out and "gated MLP" in out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_the_litgpt_fabric_example_runs_in_two_processes(strategy):
    """DDP, and Fabric's ``ModelParallelStrategy`` (FSDP2; gloo on CPU) sharding the converted model; Fabric
    launches its processes by re-running the script, so it runs as one."""
    pytest.importorskip("litgpt")
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "examples" / "litgpt_finetune.py"
    done = subprocess.run(
        [sys.executable, str(script), *SMOKE, "--devices", "2", "--strategy", strategy, "--model", "pythia-160m"],
        check=False, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "less activation memory than stock" in done.stdout, done.stdout[-3000:]


@pytest.mark.parametrize("trainer", ["trainer", "sft"])
def test_the_hugging_face_example_fine_tunes_with_the_callback(trainer, capsys):
    pytest.importorskip("trl")
    from examples import hf_finetune

    small = ["--trainer", trainer, "--steps", "2", "--samples", "32", "--hidden", "64", "--layers", "2"]
    result = hf_finetune.main(small)
    before, after = result["saved_mib"]
    assert len(result["losses"]) == 2 and all(math.isfinite(loss) for loss in result["losses"])
    assert after < 0.6 * before and "with lightning-lowmem" in capsys.readouterr().out


def test_the_litgpt_checkpoint_maker_writes_what_litgpt_reads(tmp_path):
    litgpt = pytest.importorskip("litgpt")
    from examples import litgpt_checkpoint

    litgpt_checkpoint.main([str(tmp_path / "tiny"), "--data", str(tmp_path / "data.json"), "--samples", "8"])
    config = litgpt.Config.from_file(tmp_path / "tiny" / "model_config.yaml")
    tokenizer = litgpt.Tokenizer(tmp_path / "tiny")
    assert config.padded_vocab_size == 4096 and tokenizer.vocab_size == config.vocab_size == 1024
    assert tokenizer.decode(tokenizer.encode("def stdlib_files():")) == "def stdlib_files():"
    assert len(json.loads((tmp_path / "data.json").read_text())) == 8
