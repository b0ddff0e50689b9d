"""What :func:`~lightning_lowmem.apply_lowmem` changed and did not change, and the memory it measured."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from lightning_lowmem.memory import MIB, SavedTensorMeter
from lightning_lowmem.surgery.budget import BudgetPlan

EntryKind = str
"""A family's ``kind`` (:data:`~lightning_lowmem.surgery.families.FAMILIES`), or ``"gated MLP"`` / ``"activation"``
for a rewritten forward."""
EntryStatus = Literal["converted", "already converted", "left alone"]


def summary_kinds() -> tuple[str, ...]:
    """The kinds the summary counts, in the order of the families (calls left alone as functions are in the table
    only)."""
    from lightning_lowmem.surgery.families import FAMILIES  # the families import the report's Entry

    return tuple(dict.fromkeys(f.kind for f in FAMILIES if f.kind not in ("functional", "linear")))


@dataclass(frozen=True)
class Entry:
    """One candidate module: what it was, and what happened to it (``detail`` says why)."""

    name: str
    kind: EntryKind
    was: str
    status: EntryStatus
    detail: str
    family: str = ""  # the kind of the family that decided it (a rewritten forward's is "functional")


@dataclass
class LowMemReport:
    """The candidates, their fates, and the saved-for-backward bytes of one training forward.

    ``probe`` describes the input the surgery ran on (the example, or the first training forward's
    call); the bytes are measured on it (``None`` without one): everything saved
    (``saved_bytes_*``), of which autocast's copies of weights in the compute dtype
    (``weight_copy_bytes_*``, which do not grow with the batch), and per module. ``pending``: no
    example was given and the model has not run a training forward yet.
    """

    entries: list[Entry] = field(default_factory=list)
    linears: int = 0
    saved_bytes_before: int | None = None
    saved_bytes_after: int | None = None
    weight_copy_bytes_before: int | None = None
    weight_copy_bytes_after: int | None = None
    saved_by_module_before: dict[str, int] = field(default_factory=dict)
    saved_by_module_after: dict[str, int] = field(default_factory=dict)
    step_bytes_before: int | None = None
    step_bytes_after: int | None = None
    probe: str | None = None
    pending: bool = False
    budget: BudgetPlan | None = None
    notes: list[str] = field(default_factory=list)  # other changes to the model, one line each
    gradient_error: float | None = None  # the k-bit activations' backward: |g - g_stock| / |g_stock| on the probe

    def record(self, meter: SavedTensorMeter, converted: bool, step: int | None = None) -> None:
        """Keep what ``meter`` measured on the stock (``converted=False``) or the converted model, and ``step``, what
        a training step holds at its peak, where the forward checkpoints (its recompute saves what the meter missed)."""
        suffix = "after" if converted else "before"
        setattr(self, f"step_bytes_{suffix}", step)
        setattr(self, f"saved_bytes_{suffix}", meter.total_bytes)
        setattr(self, f"weight_copy_bytes_{suffix}", meter.weight_copy_bytes)
        setattr(self, f"saved_by_module_{suffix}", meter.by_module)

    def reject(self, failures: dict[str, str]) -> None:
        """The changes of the kinds in ``failures`` were undone: the training check found them computing something
        else than the stock model, or too far from it (each kind's figures)."""
        reasons = {kind: f"rolled back: {why}" for kind, why in failures.items()}
        self.entries = [
            replace(e, status="left alone", detail=reasons[e.family])
            if e.status == "converted" and e.family in reasons
            else e
            for e in self.entries
        ]
        self.notes += [f"{kind}: {reason}" for kind, reason in reasons.items()]

    def roll_back(self, meter: SavedTensorMeter | None = None, families: dict[str, int] | None = None) -> None:
        """Changes that cost were undone: every change (the converted model saved more for backward than the stock
        one), or, given what the rest saves (``meter``), the changes of ``families`` (each: what the converted
        model saved without it)."""
        after, before = self.saved_bytes_after / MIB, self.saved_bytes_before / MIB
        reasons = {
            kind: f"rolled back: the converted model saves {after:.2f} MiB for backward with the {kind} conversions, "
            f"{without / MIB:.2f} MiB without them"
            for kind, without in (families or {}).items()
        }
        whole = f"rolled back: the converted model saved {after:.2f} MiB for backward, more than the stock model's "
        whole += f"{before:.2f} MiB"
        undone = lambda e: e.status == "converted" and (families is None or e.family in families)
        self.entries = [
            replace(e, status="left alone", detail=reasons.get(e.family, whole)) if undone(e) else e
            for e in self.entries
        ]
        self.notes += list(reasons.values()) if families else [whole]
        if meter is not None:
            self.record(meter, converted=True)
            return
        self.linears, self.saved_bytes_after = 0, self.saved_bytes_before
        self.weight_copy_bytes_after, self.saved_by_module_after = self.weight_copy_bytes_before, {}

    def _with(self, status: EntryStatus, kind: EntryKind | None = None) -> list[Entry]:
        return [e for e in self.entries if e.status == status and kind in (None, e.kind)]

    @property
    def converted(self) -> list[Entry]:
        return self._with("converted")

    @property
    def checkpointed(self) -> list[str]:
        """The blocks wrapped in activation checkpointing to fit the budget (none without one)."""
        return [] if self.budget is None else self.budget.checkpointed

    @property
    def left_alone(self) -> list[Entry]:
        return self._with("left alone")

    def status(self, name: str) -> EntryStatus:
        """The status of the module called ``name`` (KeyError if it was no candidate)."""
        for entry in self.entries:
            if entry.name == name:
                return entry.status
        raise KeyError(f"{name!r} was not a candidate for conversion")

    @property
    def activation_bytes_before(self) -> int | None:
        """Saved bytes less autocast's weight copies, of the stock model: activations proper."""
        return None if self.saved_bytes_before is None else self.saved_bytes_before - self.weight_copy_bytes_before

    @property
    def activation_bytes_after(self) -> int | None:
        """Saved bytes less autocast's weight copies, of the converted model."""
        return None if self.saved_bytes_after is None else self.saved_bytes_after - self.weight_copy_bytes_after

    @property
    def reduction(self) -> float | None:
        """Fraction of the activation bytes removed, when measured: of what a training step holds at its peak where
        the model checkpoints (one forward misses what the recompute saves), else of what one forward saves
        (autocast's weight copies apart)."""
        if self.step_bytes_before and self.step_bytes_after is not None:
            return 1.0 - self.step_bytes_after / self.step_bytes_before
        if not self.activation_bytes_before or self.activation_bytes_after is None:
            return None
        return 1.0 - self.activation_bytes_after / self.activation_bytes_before

    def summary(self) -> str:
        if self.pending:
            return "pending: converts at the model's first training forward, on that forward's input"
        counts = ", ".join(
            f"{n} {kind}{'s' * (n != 1)} {status}"
            for kind in summary_kinds()
            for status in get_args(EntryStatus)
            if (n := len(self._with(status, kind)))
        )
        line = f"{counts or 'no candidates'}; {self.linears} linear layers recast weights in backward"
        if self.step_bytes_before and self.step_bytes_after is not None:
            line += (
                f"; a training step's activations at their peak (measured: forward and backward, the checkpointed "
                f"layers recomputed): {self.step_bytes_before / MIB:.2f} MiB -> {self.step_bytes_after / MIB:.2f} MiB "
                f"(-{100 * self.reduction:.1f}%); saved for backward by one forward, outside the checkpointed layers: "
                f"{self.activation_bytes_before / MIB:.2f} MiB -> {self.activation_bytes_after / MIB:.2f} MiB"
            )
        elif self.reduction is not None:
            line += (
                f"; activations saved for backward by one forward: {self.activation_bytes_before / MIB:.2f} MiB -> "
                f"{self.activation_bytes_after / MIB:.2f} MiB (-{100 * self.reduction:.1f}%)"
            )
        if self.weight_copy_bytes_before:
            line += (
                f", autocast's weight copies: {self.weight_copy_bytes_before / MIB:.2f} MiB -> "
                f"{self.weight_copy_bytes_after / MIB:.2f} MiB"
            )
        line += f"; probed on {self.probe}" if self.probe else ""
        if self.gradient_error is not None:
            line += f"\nthe k-bit activations' backward: gradients {self.gradient_error:.1%} off stock's on the probe's batch"
            line += " (relative, all trainable tensors; the rest of the conversion is exact)"
        line += "".join(f"\n{note}" for note in self.notes)
        return line + (f"\n{self.budget.summary()}" if self.budget is not None else "")

    def table(self) -> str:
        """A ModelSummary-like table: every candidate, its fate and the reason."""
        if self.pending:
            return self.summary()
        header = ("", "Name", "Kind", "Was", "Status", "Detail")
        rows = [(str(i), e.name, e.kind, e.was, e.status, e.detail) for i, e in enumerate(self.entries)]
        widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
        fmt = lambda row: " | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        rule = "-" * len(fmt(header))
        return "\n".join([rule, fmt(header), rule, *map(fmt, rows), rule, self.summary()])

    def __str__(self) -> str:
        return self.table()
