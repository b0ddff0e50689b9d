"""Activation-memory regression gate: measure cases, compare with a committed baseline.

Activation memory (bytes of unique storages saved for backward by one training forward,
parameters and buffers excluded) depends only on shapes, dtypes and code, so it is exact
and the same on every run of a given torch version: any growth is a real change.

Use it for your own model::

    from lightning_lowmem.memcheck import Case, check

    CASES = [Case("mymodel/bf16", build=lambda: (MyModel(), torch.randn(4, 3, 224, 224)),
                  precision="bf16-mixed", lowmem=True)]

    def test_activation_memory():  # UPDATE_MEMORY=1 pytest ... writes the baseline
        result = check(CASES, "tests/activation_baseline.json", update=os.environ.get("UPDATE_MEMORY") == "1")
        assert result.ok, result.text

or from the command line (CI): ``python -m lightning_lowmem.memcheck --cases mypkg.memcases:CASES
--baseline tests/activation_baseline.json`` (add ``--update`` to write the baseline).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn

from lightning_lowmem.lightning import LowMemPrecision
from lightning_lowmem.memory import MIB, SavedTensorMeter
from lightning_lowmem.surgery import apply_lowmem
from lightning_lowmem.surgery.example import call

BASELINE = Path(__file__).with_name("baseline.json")
DEFAULT_TOLERANCE = 0.01


@dataclass(frozen=True)
class Case:
    """One configuration to measure.

    Args:
        name: key in the baseline file.
        build: returns ``(model, example_input)``; the input follows Lightning's
            ``example_input_array`` convention (tensor, tuple of positional args, or dict of
            keyword args). Called with the seed fixed.
        precision: a Lightning precision literal; ``"32-true"``, ``"16-mixed"``,
            ``"bf16-mixed"``, ``"16-true"``, ``"bf16-true"``.
        lowmem: convert the model with :func:`~lightning_lowmem.apply_lowmem` first.
        plugin: ``"lowmem"`` runs under :class:`~lightning_lowmem.LowMemPrecision`,
            ``"stock"`` under Lightning's own plugin for the literal.
    """

    name: str
    build: Callable[[], tuple[nn.Module, Any]]
    precision: str = "32-true"
    lowmem: bool = False
    plugin: str = "lowmem"

    def precision_plugin(self) -> Precision:
        if self.plugin == "lowmem":
            return LowMemPrecision(self.precision, device="cpu")  # type: ignore[arg-type]
        if self.plugin != "stock":
            raise ValueError(f"Case {self.name!r}: plugin must be 'lowmem' or 'stock', got {self.plugin!r}")
        if self.precision.endswith("-mixed"):
            return MixedPrecision(self.precision, "cpu")  # type: ignore[arg-type]
        if self.precision in ("16-true", "bf16-true"):
            return HalfPrecision(self.precision)  # type: ignore[arg-type]
        if self.precision == "32-true":
            return Precision()
        raise ValueError(f"Case {self.name!r}: unsupported precision {self.precision!r}")


def _prepare(case: Case) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model, example = case.build()
    model.train()
    if case.lowmem:
        apply_lowmem(model, example_input=example, verify=False, measure=False)
    return model, example


def _measure_prepared(case: Case, model: nn.Module, example: Any) -> int:
    plugin = case.precision_plugin()
    model = plugin.convert_module(model)
    example = plugin.convert_input(example)
    with plugin.forward_context(), SavedTensorMeter(model) as meter:
        call(model, example)
    return meter.total_bytes


def measure(case: Case) -> int:
    """Bytes saved for backward by one training forward of the case, on CPU, as a Trainer runs it."""
    return _measure_prepared(case, *_prepare(case))


@dataclass(frozen=True)
class Result:
    """The comparison: ``ok`` is False when any figure grew beyond the tolerance or has no baseline."""

    ok: bool
    text: str


def compare(figures: dict[str, int], baseline: dict[str, int], tolerance: float = DEFAULT_TOLERANCE) -> Result:
    """A table of every figure against its baseline; growth beyond ``tolerance`` (relative) fails."""
    rows, failures = [], 0
    for name, now in figures.items():
        before = baseline.get(name)
        if before is None:
            status, change = "NOT IN BASELINE", ""
            failures += 1
        else:
            growth = (now - before) / before if before else (0.0 if now == 0 else float("inf"))
            change = f"{100 * growth:+.1f}%"
            if growth > tolerance:
                status = "REGRESSION"
                failures += 1
            else:
                status = "smaller (update the baseline)" if growth < -tolerance else "ok"
        old = "-" if before is None else f"{before / MIB:.3f}"
        rows.append((name, old, f"{now / MIB:.3f}", change, status))
    header = ("case", "baseline MiB", "now MiB", "change", "status")
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    smaller = sum(row[-1].startswith("smaller") for row in rows)
    if failures:
        verdict = (
            f"memcheck: {failures} of {len(rows)} activation figures grew beyond {100 * tolerance:g}% of the "
            "baseline or have none; if the change is intended, rewrite the baseline with --update"
        )
    else:
        verdict = f"memcheck: all {len(rows)} activation figures within {100 * tolerance:g}% of the baseline or smaller"
        if smaller:
            verdict += f" ({smaller} smaller: --update tightens the baseline)"
    return Result(ok=not failures, text="\n".join([*lines, verdict]))


class ConfigError(Exception):
    """The gate cannot run as configured (a baseline or case module it cannot use): not a regression."""


def _read(path: str | Path, missing_ok: bool = False) -> tuple[dict[str, int], str | None]:
    """Bytes by case name and the torch version the baseline was written with."""
    path = Path(path)
    if not path.exists():
        if missing_ok:
            return {}, None
        raise ConfigError(f"baseline {path} does not exist; write it with --update (or pass --baseline PATH)")
    try:
        data = json.loads(path.read_text())
        return {name: int(entry["saved_bytes"]) for name, entry in data["cases"].items()}, data.get("torch")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(
            f"baseline {path} is not a memcheck baseline ({type(err).__name__}: {err}); restore it from version "
            "control or rewrite it with --update"
        ) from err


def load_baseline(path: str | Path, missing_ok: bool = False) -> dict[str, int]:
    """Bytes by case name from a baseline file; :class:`ConfigError` if it is missing (unless ``missing_ok``)
    or invalid."""
    return _read(path, missing_ok)[0]


def write_baseline(path: str | Path, figures: dict[str, int]) -> None:
    """Write (or merge into) the baseline; entries not measured now are kept."""
    cases = {name: {"saved_bytes": nbytes} for name, nbytes in {**load_baseline(path, True), **figures}.items()}
    data = {
        "unit": "bytes saved for backward by one training forward (CPU)",
        "torch": torch.__version__,
        "cases": dict(sorted(cases.items())),
    }
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def check(
    cases: Sequence[Case], baseline: str | Path = BASELINE, tolerance: float = DEFAULT_TOLERANCE, update: bool = False
) -> Result:
    """Measure every case and compare with the baseline file (or rewrite it with ``update``).

    Raises :class:`ConfigError` before measuring anything when the baseline is missing (and not
    ``update``) or invalid.
    """
    stored, written_with = _read(baseline, missing_ok=update)
    figures, prepared = {}, {}
    for case in cases:  # build (and convert) each model once; every precision gets a copy
        key = (case.build, case.lowmem)
        if key not in prepared:
            prepared[key] = _prepare(case)
        model, example = prepared[key]
        figures[case.name] = _measure_prepared(case, copy.deepcopy(model), example)
    result = compare(figures, stored, tolerance)
    if written_with not in (None, torch.__version__):
        result = Result(
            result.ok,
            f"{result.text}\nmemcheck: the baseline was written with torch {written_with}, this is {torch.__version__}",
        )
    if update:
        write_baseline(baseline, figures)
        return Result(ok=True, text=f"{result.text}\nmemcheck: baseline {baseline} updated")
    return result
