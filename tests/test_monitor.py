"""PeakMemoryMonitor in real Trainer.fit runs on CPU: loggers, summary, budget, pictures."""

from __future__ import annotations

import csv
import io
import json
import mmap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import run_ddp_script
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_utilities.core.imports import RequirementCache
from torch import nn

from lightning_lowmem import PeakMemoryMonitor
from lightning_lowmem.lightning import LowMemBP, LowMemPrecision, MemoryBudgetExceeded, plots
from lightning_lowmem.lightning.monitor import _stock_activation
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.memory.saved_tensors import MIB
from lightning_lowmem.surgery import LowMemReport

BATCH = torch.randn(8, 32)
REPO = str(Path(__file__).resolve().parents[1])
needs_matplotlib = pytest.mark.skipif(not plots.MATPLOTLIB_AVAILABLE, reason="needs matplotlib")


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


@needs_matplotlib
@pytest.mark.skipif(not RequirementCache("tensorboard"), reason="needs tensorboard")
def test_figures_and_pictures_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_logger = TensorBoardLogger(tmp_path, name="tb")
    fit(tmp_path, PeakMemoryMonitor(activation_every_n_steps=1, validation=True, plot=True), logger=tb_logger)
    events = EventAccumulator(tb_logger.log_dir)
    events.Reload()
    assert set(NAMES) <= set(events.Tags()["scalars"])
    assert [image.step for image in events.Images("peak_memory")] == [3, 6]  # after each epoch
    assert len(events.Images("peak_memory/modules")) == 1  # after the first


def test_plot_without_matplotlib_is_refused(monkeypatch):
    monkeypatch.setattr(plots, "MATPLOTLIB_AVAILABLE", RequirementCache("matplotlib>=999"))
    with pytest.raises(ModuleNotFoundError, match=r"plot=True\) draws with matplotlib.*matplotlib>=999"):
        PeakMemoryMonitor(plot=True)


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


def test_trainer_validate_logs_validation_figures(tmp_path):
    trainer = pl.Trainer(
        accelerator="cpu", default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[PeakMemoryMonitor(validation=True)],
    )  # fmt: skip
    trainer.validate(MLP())
    assert trainer.callback_metrics["peak_memory/val_cpu_rss_mib"] > 0


class SpikeInTraining(MLP):
    """Touches 256 MiB in its last training step and frees it: a peak validation must not erase. The pages are
    mapped afresh (``mmap``), not allocated: a heap that kept freed memory resident (a benchmark helper in the same
    test worker sets glibc's thresholds so) would serve an allocation without the resident set growing."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            with mmap.mmap(-1, 256 << 20) as pages:
                torch.frombuffer(pages, dtype=torch.uint8).fill_(1)
        return super().training_step(batch, batch_idx)


def test_the_training_peak_before_validation_counts(tmp_path):
    monitor = PeakMemoryMonitor(validation=True)
    pl.Trainer(
        accelerator="cpu", max_epochs=1, default_root_dir=tmp_path, logger=False, callbacks=[monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(SpikeInTraining())  # fmt: skip
    figures = monitor.history[0]
    assert figures["train"]["cpu_rss"] > figures["val"]["cpu_rss"] + 200


def test_bad_arguments_are_refused():
    with pytest.raises(MisconfigurationException, match="unknown budget 'vram'"):
        PeakMemoryMonitor(budget_mib={"vram": 10})
    with pytest.raises(MisconfigurationException, match="positive number"):
        PeakMemoryMonitor(budget_mib={"activation": -1})
    with pytest.raises(MisconfigurationException, match="activation_every_n_steps"):
        PeakMemoryMonitor(activation_every_n_steps=-1)


class PreNormMLP(pl.LightningModule):
    """Two pre-norm MLP blocks on a residual stream, with an example input for LowMemBP's probe.

    With ``final_norm`` the output goes through a LayerNorm that LowMemBP must leave alone (its
    output is the model's output, not a linear's input).
    """

    def __init__(self, final_norm: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(2)
        )
        self.norm = nn.LayerNorm(64) if final_norm else nn.Identity()
        self.example_input_array = torch.randn(4, 16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x)

    def training_step(self, batch, batch_idx):
        return self(batch).float().pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 16, 64), batch_size=4)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 16, 64), batch_size=4)


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


def png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, dpi=100)
    return buffer.getvalue()


def in_view(ax) -> list[float]:
    low, high = ax.get_xlim()
    return [tick for tick in ax.get_xticks() if low <= tick <= high]


@pytest.fixture(scope="module")
def lowmem_run(tmp_path_factory) -> tuple[Path, dict]:
    """LowMemBP + PeakMemoryMonitor(plot=True) over 2 epochs in fp32: the pictures and the JSON they came from."""
    root = tmp_path_factory.mktemp("lowmem_run")
    monitor = PeakMemoryMonitor(activation_every_n_steps=1, validation=True, budget_mib={"activation": 0.5}, plot=True)
    pl.Trainer(
        accelerator="cpu", max_epochs=2, default_root_dir=root, logger=False, callbacks=[LowMemBP(), monitor],
        plugins=[LowMemPrecision("32-true")], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(PreNormMLP(final_norm=True))  # fmt: skip
    return root, json.loads((root / "peak_memory.json").read_text())


@needs_matplotlib
def test_peak_memory_png_panels_budget_and_stock_reference(lowmem_run):
    root, summary = lowmem_run
    figure = plots.epoch_figure(summary)
    assert (root / "peak_memory.png").read_bytes() == png(figure)  # the picture is the JSON, drawn

    activation, rss = figure.axes  # one panel per kind of memory (no CUDA here)
    assert [activation.get_title(), rss.get_title()] == [
        "Activations (saved for backward)",
        "Host memory (process RSS)",
    ]
    for ax in figure.axes:
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("epoch", "peak MiB")
        assert in_view(ax) == [0, 1]  # integer epochs only
    assert "precision 32-true" in figure.get_suptitle()

    lines = {line.get_label(): line for line in activation.get_lines()}
    assert list(lines["train activations"].get_ydata()) == [row["train"]["activation"] for row in summary["epochs"]]
    assert lines["budget 0.5 MiB"].get_ydata()[0] == 0.5
    stock = summary["lowmem"]["stock_activation_mib"]
    assert lines["stock model (estimated)"].get_ydata()[0] == stock
    saving = 100 * (1 - summary["epochs"][0]["train"]["activation"] / stock)
    assert activation.texts[0].get_text() == f"stock model ≈ {stock:.2f} MiB: LowMemBP saves {saving:.1f}%"

    rss_lines = {line.get_label(): line for line in rss.get_lines()}
    assert rss_lines["train RSS"].get_linestyle() == "-" and rss_lines["val RSS"].get_linestyle() == "--"
    assert list(rss_lines["val RSS"].get_ydata()) == [row["val"]["cpu_rss"] for row in summary["epochs"]]


@needs_matplotlib
def test_a_budget_far_above_the_figures_does_not_flatten_them(lowmem_run):
    _, summary = lowmem_run
    summary["budget_mib"]["activation"] = 1000
    activation = plots.epoch_figure(summary).axes[0]
    budget = next(line for line in activation.get_lines() if line.get_label().startswith("budget"))
    assert budget.get_label() == "budget 1000 MiB (off the scale)" and len(budget.get_ydata()) == 0
    assert activation.get_ylim()[1] < 1  # the figures (about 0.2 MiB, stock 0.35 MiB) fill the panel


def test_the_stock_reference_is_the_stock_model_measured_at_this_batch(lowmem_run):
    _, summary = lowmem_run
    model = PreNormMLP(final_norm=True)
    with SavedTensorMeter(model) as meter:
        model.training_step(torch.randn(4, 16, 64), 0)
    # the estimate scales what LowMemBP measured on the example input; the loss's tensors are not in it
    assert summary["lowmem"]["stock_activation_mib"] == pytest.approx(meter.peak_bytes / MIB, rel=0.03)


def test_the_stock_estimate_scales_activations_but_not_autocasts_weight_copies():
    report = LowMemReport(saved_bytes_before=100 * int(MIB), saved_bytes_after=60 * int(MIB))
    report.weight_copy_bytes_before = report.weight_copy_bytes_after = 0
    assert _stock_activation(report, 120.0) == pytest.approx(200.0)  # the run's batch holds twice the example's
    report.weight_copy_bytes_before = 40 * int(MIB)  # of the stock 100 MiB, 40 are weight copies; none after
    assert _stock_activation(report, 120.0) == pytest.approx(60 * 2 + 40)


def test_the_stock_reference_under_mixed_precision_is_the_stock_model_at_this_batch(tmp_path):
    """bf16 autocast: the stock model saves a copy of every weight; the estimate keeps them apart."""
    monitor = PeakMemoryMonitor(activation_every_n_steps=1)
    pl.Trainer(
        accelerator="cpu", max_steps=1, default_root_dir=tmp_path, logger=False, callbacks=[LowMemBP(), monitor],
        plugins=[LowMemPrecision("bf16-mixed")], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(PreNormMLP(final_norm=True))  # fmt: skip
    summary = json.loads((tmp_path / "peak_memory.json").read_text())
    assert summary["lowmem"]["weight_copy_mib_before"] > 0 == summary["lowmem"]["weight_copy_mib_after"]
    model = PreNormMLP(final_norm=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), SavedTensorMeter(model) as meter:
        model.training_step(torch.randn(4, 16, 64), 0)
    assert summary["lowmem"]["stock_activation_mib"] == pytest.approx(meter.peak_bytes / MIB, rel=0.03)


@needs_matplotlib
def test_without_a_stock_estimate_the_png_states_the_saving_at_conversion(lowmem_run):
    _, summary = lowmem_run
    del summary["lowmem"]["stock_activation_mib"]
    activation = plots.epoch_figure(summary).axes[0]
    lowmem = summary["lowmem"]
    assert "stock model (estimated)" not in [line.get_label() for line in activation.get_lines()]
    assert activation.texts[0].get_text() == (
        "LowMemBP at conversion, on model(tensor[4, 16, 64]):\n"
        f"activations {lowmem['saved_mib_before']:.2f} → {lowmem['saved_mib_after']:.2f} MiB, "
        f"saves {100 * lowmem['reduction']:.1f}%"  # fp32: no weight copies
    )


@needs_matplotlib
def test_module_png_shows_where_memory_goes_and_what_lowmem_did(lowmem_run):
    root, summary = lowmem_run
    figure = plots.module_figure(summary, top=15)
    assert (root / "peak_memory_modules.png").read_bytes() == png(figure)

    (ax,) = figure.axes
    labels = [tick.get_text() for tick in ax.get_yticklabels()]
    assert {"blocks.*.3 ×2", "blocks.*.2 ×2", "norm"} <= set(labels)  # repeated blocks summed
    assert "one forward on model(tensor[4, 16, 64]), measured by LowMemBP" in figure.get_suptitle()
    lowmem = summary["lowmem"]
    sources = {
        "this run": summary["modules_first_epoch_mib"],
        "stock model": lowmem.get("saved_by_module_before_mib"),
        "with LowMemBP": lowmem.get("saved_by_module_after_mib"),
    }
    for bars in ax.containers:
        by_module = sources[bars.get_label().split(":")[0]]
        widths = dict(zip(labels, (bar.get_width() for bar in bars)))
        assert widths["blocks.*.3 ×2"] == pytest.approx(by_module["blocks.0.3"] + by_module["blocks.1.3"])
        assert widths["norm"] == pytest.approx(by_module["norm"])
    notes = {labels[round(text.get_position()[1])].split(" ×")[0]: text.get_text() for text in ax.texts}
    details = {entry["name"]: entry["detail"] for entry in lowmem["entries"]}
    assert notes["blocks.*.0"] == "→ MS-LN"
    assert notes["blocks.*.2"] == f"→ {details['blocks.0.2']}" == "→ ReGELU2 (erf)"
    assert notes["norm"] == f"left alone: {details['norm']}"
    assert ax.get_xlabel() == "MiB saved for backward"
    assert figure.get_suptitle().startswith("Where activation memory goes")


@needs_matplotlib
def test_module_picture_compares_stock_and_converted_top_n():
    blocks = {f"model.blocks.{i}.{part}": mib for i in range(3) for part, mib in (("attn", 2.0), ("act", 1.0))}
    summary = {
        "modules_first_epoch_mib": {},
        "lowmem": {
            "saved_by_module_before_mib": {**blocks, "model.norm": 0.5, "model.head": 0.25, "<outside>": 0.25},
            "saved_by_module_after_mib": {**blocks, "model.blocks.0.act": 0.1, "model.norm": 0.5},
            "entries": [
                {"name": "model.blocks.0.act", "status": "converted", "detail": "ReGELU2 (erf)"},
                {"name": "model.norm", "status": "left alone", "detail": "output reaches __getitem__ in model"},
            ],
        },
    }
    (ax,) = plots.module_figure(summary, top=2).axes
    stock, converted = ax.containers
    assert stock.get_label() == "stock model: 10.00 MiB"
    assert converted.get_label() == "with LowMemBP: 8.60 MiB (-14.0%)"
    assert [tick.get_text() for tick in ax.get_yticklabels()] == ["blocks.*.attn ×3", "blocks.*.act ×3", "3 more kinds"]
    assert [bar.get_width() for bar in stock] == [6.0, 3.0, 1.0]
    assert [bar.get_width() for bar in converted] == pytest.approx([6.0, 2.1, 0.5])
    assert [text.get_text() for text in ax.texts] == ["→ ReGELU2 (erf)"]  # notes of the rows shown


DDP_SCRIPT = """
import json, sys, torch, warnings
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

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


monitor = PeakMemoryMonitor(activation_every_n_steps=1, validation=True)
trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_epochs=2, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     callbacks=[monitor], default_root_dir={root!r}, num_sanity_val_steps=0)
reduced = []  # sizes of the tensors reduced across ranks
reduce = trainer.strategy.reduce

def counted(tensor, *args, **kwargs):
    if tensor.is_floating_point():  # Lightning reduces its own stop/save decisions as int tensors
        reduced.append(tensor.numel())
    return reduce(tensor, *args, **kwargs)


trainer.strategy.reduce = counted
data = torch.utils.data.DataLoader(torch.randn(16, 32), batch_size=4)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer.fit(Uneven(), data, data)
local = trainer.strategy.all_gather(torch.tensor(monitor._activation_bytes / MIB))
if trainer.global_rank == 0:
    json.dump({{"logged": trainer.callback_metrics["peak_memory/train_activation_mib"].item(),
               "summary": monitor.history[-1]["train"]["activation"], "per_rank": local.tolist(), "reduced": reduced,
               "warnings": [str(w.message) for w in caught if "sync_dist" in str(w.message)]}}, open({out!r}, "w"))
"""


def test_ddp_logs_the_max_across_ranks_in_one_reduction_per_epoch(tmp_path):
    result = run_ddp_script(tmp_path, DDP_SCRIPT)
    rank0, rank1 = result["per_rank"]
    assert rank1 > rank0
    assert result["logged"] == pytest.approx(rank1, abs=1e-3) and result["summary"] == pytest.approx(rank1, abs=1e-3)
    assert result["reduced"] == [3, 3]  # per epoch: train activation and RSS, val RSS, in one tensor
    assert result["warnings"] == []  # Lightning does not ask to sync figures that are already synced
