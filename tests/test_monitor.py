"""PeakMemoryMonitor in real Trainer.fit runs on CPU: loggers, summary, budget."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_utilities.core.imports import RequirementCache
from torch import nn

from lightning_lowmem import PeakMemoryMonitor
from lightning_lowmem.lightning import LowMemBP, LowMemPrecision, MemoryBudgetExceeded
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.memory.saved_tensors import MIB

BATCH = torch.randn(8, 32)
REPO = str(Path(__file__).resolve().parents[1])


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.net(batch).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(BATCH.repeat(3, 1), batch_size=8)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(BATCH, batch_size=8)


def fit(tmp_path, monitor: PeakMemoryMonitor, epochs: int = 2, **kwargs) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, default_root_dir=tmp_path, callbacks=[monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip
    trainer.fit(MLP())
    return trainer


NAMES = ["peak_memory/train_activation_mib", "peak_memory/train_cpu_rss_mib", "peak_memory/val_cpu_rss_mib"]


def step_activation_mib() -> float:
    model = MLP()
    with SavedTensorMeter(model) as meter:
        model.training_step(BATCH, 0)
    return meter.peak_bytes / MIB


def test_figures_reach_csv_callback_metrics_and_the_summary(tmp_path):
    monitor = PeakMemoryMonitor(activation_every_n_steps=1, validation=True, module_table=True)
    csv_logger = CSVLogger(tmp_path, name="csv")
    trainer = fit(tmp_path, monitor, logger=csv_logger)

    expected = step_activation_mib()
    assert trainer.callback_metrics[NAMES[0]].item() == pytest.approx(expected, abs=1e-3)
    assert all(trainer.callback_metrics[name] > 0 for name in NAMES)

    with open(f"{csv_logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for name in NAMES:
        assert len({row["epoch"] for row in rows if row[name]}) == 2, f"{name} not logged once per epoch"

    summary = json.loads((Path(csv_logger.log_dir) / "peak_memory.json").read_text())
    assert [row["epoch"] for row in summary["epochs"]] == [0, 1]
    assert summary["epochs"][0]["train"]["activation"] == pytest.approx(expected, abs=1e-3)
    assert "cpu_rss" in summary["epochs"][1]["val"]
    assert summary["cpu_rss_reset_per_stage"] is True  # Linux: /proc/self/clear_refs
    assert "net.0" in summary["modules_first_epoch_mib"]


@pytest.mark.skipif(not RequirementCache("tensorboard"), reason="needs tensorboard")
def test_figures_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_logger = TensorBoardLogger(tmp_path, name="tb")
    fit(tmp_path, PeakMemoryMonitor(activation_every_n_steps=1, validation=True), logger=tb_logger)
    events = EventAccumulator(tb_logger.log_dir)
    events.Reload()
    assert set(NAMES) <= set(events.Tags()["scalars"])


@pytest.mark.skipif(not RequirementCache("matplotlib"), reason="needs matplotlib")
def test_plot_per_epoch(tmp_path):
    fit(tmp_path, PeakMemoryMonitor(plot=True), logger=False)
    assert (tmp_path / "peak_memory.png").stat().st_size > 0


def test_exceeding_a_budget_fails_the_run_naming_metric_budget_and_value(tmp_path):
    monitor = PeakMemoryMonitor(activation_every_n_steps=1, budget_mib={"activation": 0.001})
    with pytest.raises(
        MemoryBudgetExceeded,
        match=r"peak_memory/train_activation_mib = \d+\.\d\d MiB exceeds its budget of 0\.001 MiB \(epoch 0\)",
    ):
        fit(tmp_path, monitor, logger=False)
    assert (tmp_path / "peak_memory.json").exists()  # the summary is written before failing


def test_sampling_off_logs_no_activation(tmp_path):
    trainer = fit(tmp_path, PeakMemoryMonitor(activation_every_n_steps=0), epochs=1, logger=False)
    assert "peak_memory/train_activation_mib" not in trainer.callback_metrics
    assert "peak_memory/train_cpu_rss_mib" in trainer.callback_metrics


def test_bad_arguments_are_refused():
    with pytest.raises(MisconfigurationException, match="unknown budget 'vram'"):
        PeakMemoryMonitor(budget_mib={"vram": 10})
    with pytest.raises(MisconfigurationException, match="positive number"):
        PeakMemoryMonitor(budget_mib={"activation": -1})
    with pytest.raises(MisconfigurationException, match="activation_every_n_steps"):
        PeakMemoryMonitor(activation_every_n_steps=-1)


class PreNormMLP(pl.LightningModule):
    """Two pre-norm MLP blocks on a residual stream, with an example input for LowMemBP's probe."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(2)
        )
        self.example_input_array = torch.randn(4, 16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x

    def training_step(self, batch, batch_idx):
        return self(batch).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 16, 64), batch_size=4)


def test_lowmem_bp_and_precision_show_in_the_logged_activation(tmp_path):
    """The whole stack in one Trainer: LowMemBP + LowMemPrecision, measured by the monitor."""
    logged = {}
    for name, callbacks in (("stock", []), ("lowmem", [LowMemBP(verify=False, measure=False)])):
        monitor = PeakMemoryMonitor(activation_every_n_steps=1)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=2, default_root_dir=tmp_path / name, logger=False,
            callbacks=[*callbacks, monitor], plugins=[LowMemPrecision("bf16-mixed")],
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(PreNormMLP())
        logged[name] = trainer.callback_metrics["peak_memory/train_activation_mib"].item()
    assert logged["lowmem"] < 0.6 * logged["stock"], logged


DDP_SCRIPT = """
import json, sys, torch
import lightning.pytorch as pl
from torch import nn
from lightning_lowmem import PeakMemoryMonitor
from lightning_lowmem.memory.saved_tensors import MIB


class Uneven(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(32, 32)

    def training_step(self, batch, batch_idx):
        h = self.net(batch)
        if self.global_rank == 1:
            h = h.exp() * h  # rank 1 saves more for backward
        return h.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


monitor = PeakMemoryMonitor(activation_every_n_steps=1)
trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_epochs=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     callbacks=[monitor], default_root_dir={root!r})
trainer.fit(Uneven(), torch.utils.data.DataLoader(torch.randn(16, 32), batch_size=4))
local = trainer.strategy.all_gather(torch.tensor(monitor._activation_bytes / MIB))
if trainer.global_rank == 0:
    json.dump({{"logged": trainer.callback_metrics["peak_memory/train_activation_mib"].item(),
               "summary": monitor.history[0]["train"]["activation"], "per_rank": local.tolist()}}, open({out!r}, "w"))
"""


def test_ddp_logs_the_max_across_ranks(tmp_path):
    out, script = tmp_path / "ddp.json", tmp_path / "ddp_run.py"
    script.write_text(DDP_SCRIPT.format(root=str(tmp_path), out=str(out)))
    env = {k: v for k, v in os.environ.items() if k.startswith(("LIGHTNING_LOWMEM", "HOME", "TMP", "PATH"))}
    subprocess.run(
        [sys.executable, str(script)], check=True, cwd=tmp_path, env={**env, "PYTHONPATH": REPO}, timeout=300
    )
    result = json.loads(out.read_text())
    rank0, rank1 = result["per_rank"]
    assert rank1 > rank0
    assert result["logged"] == pytest.approx(rank1, abs=1e-3) and result["summary"] == pytest.approx(rank1, abs=1e-3)
