"""Baseline vs lightning-lowmem, side by side: the README's main job.

Fine-tunes a timm ViT on scikit-learn's bundled digits twice from the same seed, once with
stock backpropagation and once with ``LowMemBP`` + ``LowMemPrecision``, and prints, for each run:
the activation memory (saved-for-backward bytes of a training step), the peak CUDA memory on a
GPU, the step time (median and interquartile range during the runs, and the median of the two
trained models' steps timed in alternation afterwards: the runs follow one another, so a shared
machine's drift lands in their times, not in the alternated ones) and the last epoch's validation
accuracy and loss. It writes the same per epoch to ``compare.json`` and draws it in ``compare.png`` under
``--root``. Nothing is downloaded.

    python examples/compare.py                              # about 1 minute on a 2-core CPU
    python examples/compare.py --tuning lora_qv --epochs 5
    python examples/compare.py --figure docs/compare.png    # the README's picture

One seed: the two runs' accuracy and loss differ by about as much as two seeds of one run do
(``benchmarks/parity.py`` compares them over several seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_lowmem import LowMemBP, LowMemPrecision, PeakMemoryMonitor, kernels
from lightning_lowmem.lightning import plots

try:
    from vit_finetune import DigitsDataModule, ViTFineTuner
except ImportError:  # run from the repository root, not from examples/
    from examples.vit_finetune import DigitsDataModule, ViTFineTuner

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RUNS = {"baseline": plots.STOCK, "lowmem": plots.CONVERTED}


class StepTimer(Callback):
    """Wall time of each training step (forward, backward, optimizer), the first steps' warm-up skipped."""

    def __init__(self, warmup: int = 3) -> None:
        self.warmup, self.times_ms, self._start = warmup, [], 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if trainer.global_step > self.warmup:
            self.times_ms.append(1000 * (time.perf_counter() - self._start))


class ValidationRecorder(Callback):
    """Validation accuracy and loss of every epoch (the validation ran before the epoch's end)."""

    def __init__(self) -> None:
        self.acc, self.loss = [], []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.acc.append(float(trainer.callback_metrics["val/acc"]))
        self.loss.append(float(trainer.callback_metrics["val/loss"]))


def run(lowmem: bool, args: argparse.Namespace) -> tuple[dict[str, Any], pl.LightningModule]:
    """One fine-tuning run: its figures per epoch and its step times, and the trained model."""
    pl.seed_everything(args.seed, verbose=False)
    monitor, timer, validation = PeakMemoryMonitor(activation_every_n_steps=10), StepTimer(), ValidationRecorder()
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        callbacks=[*([LowMemBP()] if lowmem else []), monitor, timer, validation],
        plugins=[LowMemPrecision(args.precision)] if lowmem else None,
        precision=None if lowmem else args.precision,
        default_root_dir=str(Path(args.root) / ("lowmem" if lowmem else "baseline")),
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_train_batches=args.limit_batches,
        limit_val_batches=args.limit_batches,
    )
    model = ViTFineTuner(tuning=args.tuning, img_size=args.img_size, patch_size=args.patch_size, lr=args.lr)
    trainer.fit(model, DigitsDataModule(img_size=args.img_size, batch_size=args.batch_size))
    result = {
        "epoch": [row["epoch"] for row in monitor.history],
        "activation_mib": [row["train"]["activation"] for row in monitor.history],
        "val_acc": validation.acc,
        "val_loss": validation.loss,
        "step_ms": timer.times_ms,
    }
    if "cuda_allocated" in monitor.history[0]["train"]:
        result["cuda_allocated_mib"] = [row["train"]["cuda_allocated"] for row in monitor.history]
    return result, model


def alternated_step_ms(models: dict[str, pl.LightningModule], args: argparse.Namespace, rounds: int = 30) -> dict:
    """Training steps (forward, backward, AdamW) of the trained models on one batch, the two taking turns (who
    goes first alternating too), after 3 warm-up steps each: per model the step times in ms."""
    data = DigitsDataModule(img_size=args.img_size, batch_size=args.batch_size)
    data.setup("fit")
    images, labels = next(iter(data.train_dataloader()))
    autocast = args.precision.startswith("bf16")
    steps = {}
    for name, model in models.items():
        device = next(model.parameters()).device
        batch = images.to(device), labels.to(device)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)

        def step(model=model, batch=batch, optimizer=optimizer, device=device) -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = torch.nn.functional.cross_entropy(model(batch[0]).float(), batch[1])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()

        steps[name] = step
    times = {name: [] for name in models}
    for round_ in range(rounds + 3):
        for name in list(steps)[:: 1 if round_ % 2 == 0 else -1]:
            start = time.perf_counter()
            steps[name]()
            if round_ >= 3:
                times[name].append(1000 * (time.perf_counter() - start))
    return times


def header(args: argparse.Namespace) -> dict[str, str]:
    """What ran where: the device and the kernel backend decide what the step times mean."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    return {
        "run": f"ViT ({args.tuning}) on sklearn digits, {args.epochs} epochs, batch {args.batch_size}, "
        f"precision {args.precision}, seed {args.seed}",
        "device": name,
        "kernels": kernels.backend(device),
    }


def table(runs: dict[str, dict[str, Any]]) -> str:
    """Last epoch's figures: memory and time change as ratios, accuracy and loss as differences."""
    base, low = runs["baseline"], runs["lowmem"]
    rows = [("", "baseline", "lowmem", "change")]
    for label, key in (("activation MiB", "activation_mib"), ("peak CUDA MiB", "cuda_allocated_mib")):
        if key in base:
            rows.append((label, f"{base[key][-1]:.2f}", f"{low[key][-1]:.2f}", _percent(base[key][-1], low[key][-1])))
    median = [statistics.median(run["step_ms"]) if run["step_ms"] else float("nan") for run in (base, low)]
    rows.append(("step ms, median", f"{median[0]:.1f}", f"{median[1]:.1f}", _percent(*median)))
    rows.append(("step ms, IQR", _quartiles(base["step_ms"]), _quartiles(low["step_ms"]), ""))
    alternated = [statistics.median(run["alternated_step_ms"]) for run in (base, low)]
    rows.append(("step ms, alternated", f"{alternated[0]:.1f}", f"{alternated[1]:.1f}", _percent(*alternated)))
    acc = [100 * run["val_acc"][-1] for run in (base, low)]
    rows.append(("val acc %", f"{acc[0]:.1f}", f"{acc[1]:.1f}", f"{acc[1] - acc[0]:+.1f} pts"))
    loss = [run["val_loss"][-1] for run in (base, low)]
    rows.append(("val loss", f"{loss[0]:.3f}", f"{loss[1]:.3f}", f"{loss[1] - loss[0]:+.3f}"))
    return "\n".join(f"{a:<18}{b:>14}{c:>14}{d:>12}" for a, b, c, d in rows)


def _percent(before: float, after: float) -> str:
    return f"{100 * (after / before - 1):+.1f}%"


def _quartiles(times: list[float]) -> str:
    if len(times) < 2:
        return "n/a"
    q1, _, q3 = statistics.quantiles(times, n=4)
    return f"{q1:.1f}-{q3:.1f}"


def figure(summary: dict[str, Any]) -> Figure:
    """The two runs per epoch: memory (activations; CUDA on a GPU), step time, validation accuracy."""
    from matplotlib.figure import Figure

    runs = summary["runs"]
    memory = {
        "Activations (saved for backward)": "activation_mib",
        "Peak CUDA memory (allocated)": "cuda_allocated_mib",
    }
    memory = {title: key for title, key in memory.items() if key in runs["baseline"]}
    fig = Figure(figsize=(4 * (len(memory) + 2), 3.8), layout="constrained")
    *memory_axes, step, accuracy = fig.subplots(1, len(memory) + 2)
    for ax, (title, key) in zip(memory_axes, memory.items()):
        _per_epoch(ax, runs, key, scale=1)
        saved = 1 - runs["lowmem"][key][-1] / runs["baseline"][key][-1]
        ax.text(0.03, 0.97, f"lowmem saves {100 * saved:.1f}%", transform=ax.transAxes, va="top", fontsize="small")
        ax.set(title=title, ylabel="peak MiB", ylim=(0, 1.25 * max(runs["baseline"][key])))
    boxes = step.boxplot(
        [runs[name]["step_ms"] for name in RUNS], tick_labels=list(RUNS), showfliers=False, patch_artist=True,
        medianprops={"color": "black"},
    )  # fmt: skip
    for box, color in zip(boxes["boxes"], RUNS.values()):
        box.set_facecolor(color)
    step.set(title="Step time (median, quartiles)", ylabel="ms per training step", ylim=(0, None))
    _per_epoch(accuracy, runs, "val_acc", scale=100)
    accuracy.set(title="Validation accuracy", ylabel="%", ylim=(0, 100))
    fig.suptitle(f"{summary['run']}\n{summary['device']}, lightning-lowmem kernels: {summary['kernels']}")
    return fig


def _per_epoch(ax: Any, runs: dict[str, dict[str, Any]], key: str, scale: float) -> None:
    for name, color in RUNS.items():
        ax.plot(runs[name]["epoch"], [scale * value for value in runs[name][key]], color=color, marker="o", label=name)
    plots.epoch_axis(ax, runs["baseline"]["epoch"])
    ax.legend(fontsize="small")


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tuning", default="full", choices=["full", "lora_qv", "lora_all", "lora_fa"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    # from random init: at 1e-3 neither run learns in 3 epochs (val acc ~0.2); 1e-4 reaches ~0.6
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=8)
    parser.add_argument("--precision", default="bf16-mixed" if torch.cuda.is_available() else "32-true")
    parser.add_argument("--limit-batches", type=float, default=1.0, help="fraction or count of batches per epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default="lightning_logs/compare")
    parser.add_argument("--figure", help="where to draw the picture (default: ROOT/compare.png); needs matplotlib")
    args = parser.parse_args(argv)
    if args.limit_batches > 1:
        args.limit_batches = int(args.limit_batches)

    trained = {name: run(lowmem, args) for name, lowmem in (("baseline", False), ("lowmem", True))}
    runs = {name: result for name, (result, _) in trained.items()}
    alternated = alternated_step_ms({name: model for name, (_, model) in trained.items()}, args)
    for name, times in alternated.items():
        runs[name]["alternated_step_ms"] = times
    summary = {**header(args), "runs": runs}
    print(f"\n{summary['run']}\n{summary['device']}, lightning-lowmem kernels: {summary['kernels']}\n")
    print(table(runs))
    saved = 1 - runs["lowmem"]["activation_mib"][-1] / runs["baseline"]["activation_mib"][-1]
    print(f"\nActivation memory saved by lightning-lowmem: {100 * saved:.1f}%")
    Path(args.root).mkdir(parents=True, exist_ok=True)
    (Path(args.root) / "compare.json").write_text(json.dumps(summary, indent=2))
    if args.figure or plots.MATPLOTLIB_AVAILABLE:
        path = Path(args.figure or Path(args.root) / "compare.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        figure(summary).savefig(path, dpi=100)
        print(f"Per epoch: {path}")
    return runs


if __name__ == "__main__":
    main()
