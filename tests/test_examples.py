"""The examples run: every yaml config under LightningCLI, and the README's main job, shortened."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples import compare, llama_finetune, vit_finetune

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


def test_method_switches_on_from_the_command_line(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = CONFIGS[0].with_name("vit_lora_baseline.yaml")
    cli = LightningCLI(
        vit_finetune.ViTFineTuner, vit_finetune.DigitsDataModule,
        args=["fit", "--config", str(config), "--trainer.fast_dev_run=1", f"--trainer.default_root_dir={tmp_path}",
              "--trainer.callbacks+=lightning_lowmem.LowMemBP"],
    )  # fmt: skip
    assert any(type(m).__name__ == "ReGELU2" for m in cli.model.modules())


def test_main_job_prints_the_saving(capsys, tmp_path):
    results = compare.main(["--epochs", "1", "--limit-batches", "2", "--batch-size", "8", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    assert "Activation memory saved by lightning-lowmem" in out
    assert results["lowmem"]["activation MiB"] < 0.8 * results["baseline"]["activation MiB"]
    assert torch.isfinite(torch.tensor(results["lowmem"]["train loss"]))


def test_stdlib_text_is_real_python_source():
    text = llama_finetune.stdlib_text(20_000)
    assert len(text) == 20_000 and b"def " in text and b"import " in text
