"""PeakMemoryMonitor: peak memory per epoch, logged through ``pl_module.log`` to every logger.

Figures (MiB, max across ranks), logged as ``peak_memory/{stage}_{name}_mib``:

- ``activation``: peak bytes held for backward during a training step, from
  :class:`~lightning_lowmem.memory.SavedTensorMeter` (the figure LowMemBP reduces and the one
  that is the same on every device). Sampled every ``activation_every_n_steps`` batches: the
  meter's pack hook runs on every saved tensor of a sampled step, unsampled steps cost nothing.
- ``cuda_allocated`` / ``cuda_reserved``: ``torch.cuda.max_memory_allocated`` /
  ``max_memory_reserved`` since the stage started (CUDA only).
- ``cpu_rss``: the process's peak resident set size (``VmHWM``) since the stage started. Linux
  resets the high-water mark through ``/proc/self/clear_refs``; where that is not possible the
  figure is the peak since the process started, and the monitor says so once.

Training figures exclude the validation loops that run inside a training epoch; validation
figures are logged with ``validation=True``. All figures of an epoch are reduced across ranks in
one all-reduce at the end of the training epoch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_lowmem.lightning import plots
from lightning_lowmem.lightning.lowmem_bp import LowMemBP
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.memory.saved_tensors import MIB

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from lightning_lowmem.surgery import LowMemReport

METRICS = ("activation", "cuda_allocated", "cuda_reserved", "cpu_rss")
Figures = dict[str, float]


class MemoryBudgetExceeded(RuntimeError):
    """A peak-memory figure exceeded the budget given to :class:`PeakMemoryMonitor`."""


class PeakMemoryMonitor(Callback):
    """Log peak memory per epoch to every logger, check budgets, write a JSON summary and pictures.

    Args:
        activation_every_n_steps: measure the activation memory of every n-th training batch
            (the first of each epoch included); 0 turns the measurement off.
        validation: also log peak CUDA / RSS memory of each validation epoch.
        budget_mib: upper bounds in MiB by figure name (``activation``, ``cuda_allocated``,
            ``cuda_reserved``, ``cpu_rss``), checked in every stage that measures the figure;
            exceeding one raises :class:`MemoryBudgetExceeded` at the end of that epoch.
        module_table: at the end of the first training epoch, print which modules hold the
            most activation memory.
        top: rows of that table and of the per-module picture.
        plot: draw the pictures of :mod:`~lightning_lowmem.lightning.plots` (needs matplotlib):
            ``peak_memory.png`` (figures per epoch, one panel per kind of memory, budgets, and
            the stock model's activation figure when LowMemBP measured it) after every training
            epoch, and ``peak_memory_modules.png`` (where activation memory goes, per module)
            after the first. Loggers that take figures (TensorBoard) get them too.

    On rank 0, ``peak_memory.json`` in ``trainer.log_dir`` (or ``default_root_dir`` without a
    logger) is rewritten after every training epoch; it holds every figure of every epoch, the
    first epoch's per-module breakdown and, with :class:`~lightning_lowmem.LowMemBP`, what it
    measured and converted.

    Overhead: a sampled step runs Python hooks on every module and every saved tensor, measured
    at 5-7 ms of CPU time per sampled step for timm ViTs (2-4 blocks, 2-core CPU), i.e. +1% to
    +6% of such a step; at the default of every 10th step, +0.1% to +0.6% of the epoch. Raise
    ``activation_every_n_steps`` where steps are short (fast GPUs).
    """

    def __init__(
        self,
        activation_every_n_steps: int = 10,
        validation: bool = False,
        budget_mib: dict[str, float] | None = None,
        module_table: bool = False,
        top: int = 15,
        plot: bool = False,
    ) -> None:
        if not isinstance(activation_every_n_steps, int) or activation_every_n_steps < 0:
            raise MisconfigurationException(
                f"PeakMemoryMonitor: activation_every_n_steps must be an int >= 0, got {activation_every_n_steps!r}"
            )
        budget_mib = dict(budget_mib or {})
        for name, value in budget_mib.items():
            if name not in METRICS:
                raise MisconfigurationException(
                    f"PeakMemoryMonitor: unknown budget {name!r}; budgets can be set for {', '.join(METRICS)}"
                )
            if not isinstance(value, (int, float)) or value <= 0:
                raise MisconfigurationException(
                    f"PeakMemoryMonitor: budget {name!r} must be a positive number of MiB, got {value!r}"
                )
        if plot and not plots.MATPLOTLIB_AVAILABLE:
            raise ModuleNotFoundError(
                f"PeakMemoryMonitor(plot=True) draws with matplotlib. {plots.MATPLOTLIB_AVAILABLE}"
            )
        self.activation_every_n_steps = activation_every_n_steps
        self.validation = validation
        self.budget_mib = budget_mib
        self.module_table = module_table
        self.top = top
        self.plot = plot
        self.history: list[dict[str, Any]] = []
        self.modules_mib: dict[str, float] = {}
        self._meter: SavedTensorMeter | None = None
        self._activation_bytes = 0
        self._train: Figures = {}
        self._validation: Figures = {}
        self._rss_resets = True

    # -- training --------------------------------------------------------------------------
    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._train, self._validation = {}, {}
        self._activation_bytes = 0
        self._reset(trainer.strategy.root_device)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.activation_every_n_steps and batch_idx % self.activation_every_n_steps == 0:
            self._meter = SavedTensorMeter(pl_module, gpu_dropout=False).__enter__()  # what this device keeps

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._close_meter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._close_meter()  # a step that returned no loss never reached backward

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close_meter()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stages = {"train": _max_merge(self._train, self._read(trainer.strategy.root_device))}
        if self.activation_every_n_steps:
            stages["train"]["activation"] = self._activation_bytes / MIB
        if self._validation:
            stages["val"] = self._validation
        stages = self._reduce_and_log(trainer, pl_module, stages)
        self.history.append({"epoch": trainer.current_epoch, **stages})
        first = len(self.history) == 1
        if first and self.module_table and self.modules_mib:
            rows = "\n".join(f"  {name:<50} {mib:>10.3f}" for name, mib in list(self.modules_mib.items())[: self.top])
            rank_zero_info(f"PeakMemoryMonitor: modules holding the most activation memory (MiB):\n{rows}")
        log_dir = _log_dir(trainer)  # on every rank: trainer.log_dir is a collective
        if trainer.is_global_zero:
            summary = self._summary(trainer)
            log_dir.mkdir(parents=True, exist_ok=True)
            (log_dir / "peak_memory.json").write_text(json.dumps(summary, indent=2))
            if self.plot:
                self._draw(trainer, log_dir / "peak_memory.png", "peak_memory", plots.epoch_figure(summary))
            if self.plot and first:
                figure = plots.module_figure(summary, self.top)
                self._draw(trainer, log_dir / "peak_memory_modules.png", "peak_memory/modules", figure)
        self._check_budget(stages, trainer.current_epoch)

    # -- validation ------------------------------------------------------------------------
    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if trainer.state.fn == TrainerFn.FITTING:  # the training peak so far, before the reset
            self._train = _max_merge(self._train, self._read(trainer.strategy.root_device))
        self._reset(trainer.strategy.root_device)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if self.validation:
            self._validation = _max_merge(self._validation, self._read(trainer.strategy.root_device))
            if trainer.state.fn != TrainerFn.FITTING:  # no training epoch end to log them
                stages = self._reduce_and_log(trainer, pl_module, {"val": self._validation})
                self._validation = {}
                self._check_budget(stages, trainer.current_epoch)
        self._reset(trainer.strategy.root_device)

    # -- measurement -----------------------------------------------------------------------
    def _close_meter(self) -> None:
        meter, self._meter = self._meter, None
        if meter is None:
            return
        meter.__exit__(None, None, None)
        if meter.peak_bytes > self._activation_bytes:
            self._activation_bytes = meter.peak_bytes
            if not self.history:  # the first epoch's largest step
                self.modules_mib = {name: round(nbytes / MIB, 4) for name, nbytes in meter.by_module.items()}

    def _reset(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if self._rss_resets and not _reset_peak_rss():
            self._rss_resets = False
            rank_zero_warn(
                "PeakMemoryMonitor: the peak RSS cannot be reset here (it needs Linux's /proc/self/clear_refs); "
                "cpu_rss is the process's peak since it started, not per epoch"
            )

    @staticmethod
    def _read(device: torch.device) -> Figures:
        figures = {}
        if device.type == "cuda":
            figures["cuda_allocated"] = torch.cuda.max_memory_allocated(device) / MIB
            figures["cuda_reserved"] = torch.cuda.max_memory_reserved(device) / MIB
        rss = _peak_rss_bytes()
        if rss is not None:
            figures["cpu_rss"] = rss / MIB
        return figures

    @staticmethod
    def _reduce_and_log(
        trainer: pl.Trainer, pl_module: pl.LightningModule, stages: dict[str, Figures]
    ) -> dict[str, Figures]:
        """Log the max across ranks of every figure of every stage (one all-reduce); return those maxima."""
        keys = [(stage, name) for stage, figures in stages.items() for name in sorted(figures)]
        if not keys:
            return {}
        figures = [stages[stage][name] for stage, name in keys]
        local = torch.tensor(figures, dtype=torch.float64, device=trainer.strategy.root_device)
        values = trainer.strategy.reduce(local, reduce_op="max").tolist()
        result: dict[str, Figures] = {stage: {} for stage in stages}
        for (stage, name), value in zip(keys, values):
            result[stage][name] = round(value, 3)
            # already reduced: rank_zero_only makes Lightning's own per-metric sync a no-op, and
            # sync_dist=True keeps away its advice to sync an epoch-level metric
            pl_module.log(
                f"peak_memory/{stage}_{name}_mib", result[stage][name],
                on_step=False, on_epoch=True, sync_dist=True, rank_zero_only=True,
            )  # fmt: skip
        return result

    def _check_budget(self, stages: dict[str, Figures], epoch: int) -> None:
        for stage, figures in stages.items():
            for name, value in figures.items():
                budget = self.budget_mib.get(name)
                if budget is not None and value > budget:
                    raise MemoryBudgetExceeded(
                        f"PeakMemoryMonitor: peak_memory/{stage}_{name}_mib = {value:.2f} MiB exceeds its budget of "
                        f"{budget:g} MiB (epoch {epoch})"
                    )

    # -- outputs ---------------------------------------------------------------------------
    def _summary(self, trainer: pl.Trainer) -> dict[str, Any]:
        summary = {
            "unit": "MiB",
            "device": str(trainer.strategy.root_device),
            "precision": trainer.precision,
            "activation_every_n_steps": self.activation_every_n_steps,
            "cpu_rss_reset_per_stage": self._rss_resets,
            "budget_mib": self.budget_mib,
            "epochs": self.history,
            "modules_first_epoch_mib": self.modules_mib,
        }
        report = next((cb.report for cb in trainer.callbacks if isinstance(cb, LowMemBP) and cb.report), None)
        if report is not None:
            activation = self.history[0]["train"].get("activation")
            outside = self.modules_mib.get("<outside>", 0.0)
            summary["lowmem"] = _lowmem_summary(report, activation, outside)
        return summary

    @staticmethod
    def _draw(trainer: pl.Trainer, path: Path, tag: str, figure: Figure | None) -> None:
        """Write ``figure`` to ``path`` and hand it to every logger that takes figures (TensorBoard)."""
        if figure is None:
            return
        figure.savefig(path, dpi=100)
        for logger in trainer.loggers:
            add_figure = getattr(logger.experiment, "add_figure", None)
            if add_figure is not None:
                add_figure(tag, figure, global_step=trainer.global_step, close=False)


def _lowmem_summary(report: LowMemReport, activation_mib: float | None, outside_mib: float) -> dict[str, Any]:
    """What LowMemBP converted, left alone and measured at conversion, for the pictures.

    ``outside_mib``: what the training step saved outside the model (the loss), which the
    measurement at conversion does not see and the surgery does not change.
    """
    summary: dict[str, Any] = {
        "entries": [dataclasses.asdict(entry) for entry in report.entries],
        "probe": report.probe,
    }
    if report.reduction is not None:
        summary["saved_mib_before"] = round(report.saved_bytes_before / MIB, 4)
        summary["saved_mib_after"] = round(report.saved_bytes_after / MIB, 4)
        summary["weight_copy_mib_before"] = round(report.weight_copy_bytes_before / MIB, 4)
        summary["weight_copy_mib_after"] = round(report.weight_copy_bytes_after / MIB, 4)
        summary["reduction"] = round(report.reduction, 4)
        stock = _stock_activation(report, activation_mib and activation_mib - outside_mib)
        if stock is not None:
            summary["stock_activation_mib"] = round(stock + outside_mib, 3)
        for stage in ("before", "after"):
            by_module = getattr(report, f"saved_by_module_{stage}")
            summary[f"saved_by_module_{stage}_mib"] = {name: round(n / MIB, 4) for name, n in by_module.items()}
    if report.budget is not None:
        plan = report.budget
        summary["budget"] = {
            "budget_mib": round(plan.budget_bytes / MIB, 4),
            "predicted_mib": round(plan.predicted_bytes / MIB, 4),
            "forward_mib": round(plan.forward_bytes / MIB, 4),
            "recompute_mib": round(plan.recompute_bytes / MIB, 4),
            "checkpointed": plan.checkpointed,
        }
    return summary


def _stock_activation(report: LowMemReport, activation_mib: float | None) -> float | None:
    """The stock model's MiB at this run's batch, from the converted model's figure and LowMemBP's measurement.

    The report measured one forward on the example input, not on this run's batch. Activations
    grow with the batch and scale by the ratio the converted model shows; autocast's weight copies
    do not, so they are kept apart.
    """
    if not activation_mib or not report.activation_bytes_after:
        return None
    scale = (activation_mib * MIB - report.weight_copy_bytes_after) / report.activation_bytes_after
    return (report.activation_bytes_before * scale + report.weight_copy_bytes_before) / MIB


def _log_dir(trainer: pl.Trainer) -> Path:
    return Path(trainer.log_dir or trainer.default_root_dir)


def _max_merge(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {name: max(a.get(name, 0.0), b.get(name, 0.0)) for name in a.keys() | b.keys()}


def _peak_rss_bytes() -> int | None:
    """Peak resident set size: Linux's VmHWM, else ``getrusage`` (never reset), else None."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    if not os.path.exists("/proc/self/clear_refs"):
        return False
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True
