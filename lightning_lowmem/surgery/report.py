"""What :func:`~lightning_lowmem.apply_lowmem` changed and did not change, and the memory it measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from lightning_lowmem.memory import MIB

EntryKind = Literal["activation", "gated MLP", "norm", "functional"]
EntryStatus = Literal["converted", "already converted", "left alone"]


@dataclass(frozen=True)
class Entry:
    """One candidate module: what it was, and what happened to it (``detail`` says why)."""

    name: str
    kind: EntryKind
    was: str
    status: EntryStatus
    detail: str


@dataclass
class LowMemReport:
    """The candidates, their fates, and the saved-for-backward bytes of one training forward.

    ``probe`` describes the input the surgery ran on (the example, or the first training forward's
    call); ``saved_bytes_before`` / ``_after`` are measured on it (``None`` without one).
    ``pending``: no example was given and the model has not run a training forward yet.
    """

    entries: list[Entry] = field(default_factory=list)
    linears: int = 0
    saved_bytes_before: int | None = None
    saved_bytes_after: int | None = None
    probe: str | None = None
    pending: bool = False

    def _with(self, status: EntryStatus, kind: EntryKind | None = None) -> list[Entry]:
        return [e for e in self.entries if e.status == status and kind in (None, e.kind)]

    @property
    def converted(self) -> list[Entry]:
        return self._with("converted")

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
    def reduction(self) -> float | None:
        """Fraction of saved-for-backward bytes removed, when measured."""
        if not self.saved_bytes_before or self.saved_bytes_after is None:
            return None
        return 1.0 - self.saved_bytes_after / self.saved_bytes_before

    def summary(self) -> str:
        if self.pending:
            return "pending: converts at the model's first training forward, on that forward's input"
        counts = ", ".join(
            f"{len(self._with(status, kind))} {kind}s {status}"
            for kind in ("activation", "gated MLP", "norm")
            for status in get_args(EntryStatus)
            if self._with(status, kind)
        )
        line = f"{counts or 'no candidates'}; {self.linears} linear layers recast weights in backward"
        if self.reduction is not None:
            line += (
                f"; saved for backward by one forward: {self.saved_bytes_before / MIB:.2f} MiB -> "
                f"{self.saved_bytes_after / MIB:.2f} MiB (-{100 * self.reduction:.1f}%)"
            )
        return line + (f"; probed on {self.probe}" if self.probe else "")

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
