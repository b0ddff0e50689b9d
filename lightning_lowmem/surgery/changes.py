"""What a plan is made of: :class:`Change`\\ s to the model, each applied through :class:`~.convert.Surgery` (so that
it can be undone), and the report's entries. Families decide the changes (:mod:`.families`); the driver applies
them in order without knowing what they are for (:func:`~.apply.run`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_lowmem.surgery.convert import Surgery
from lightning_lowmem.surgery.report import Entry


class Change(ABC):
    """One change to the model."""

    @abstractmethod
    def apply(self, surgery: Surgery) -> None:
        """Make the change through ``surgery``, which can undo it."""


@dataclass(frozen=True)
class Replace(Change):
    """Put ``new`` wherever ``old`` is held (a module, its norm shared or its dropout folded into it)."""

    old: nn.Module
    new: nn.Module

    def apply(self, surgery: Surgery) -> None:
        surgery.replace(self.old, self.new)


@dataclass(frozen=True)
class Install(Change):
    """Shadow the class's method ``method`` of ``module`` with ``value`` on the instance (a rewritten forward)."""

    module: nn.Module
    method: str
    value: object

    def apply(self, surgery: Surgery) -> None:
        surgery.override(self.module, self.method, self.value)


@dataclass(frozen=True)
class SetAttribute(Change):
    """Set ``obj.attr`` (peft's ``cast_input_dtype_enabled``)."""

    obj: object
    attr: str
    value: object

    def apply(self, surgery: Surgery) -> None:
        surgery.set(self.obj, self.attr, self.value)


@dataclass(frozen=True)
class AddHooks(Change):
    """Hooks on ``module`` that ``install`` registers, returning their handles."""

    module: nn.Module
    install: Callable[[nn.Module], list[RemovableHandle]]

    def apply(self, surgery: Surgery) -> None:
        surgery.keep_hooks(self.install(self.module))


@dataclass
class Plan:
    """The changes in the order they apply, each with the kind of the family that planned it (``kinds``), the report
    entries, and what later families read of earlier ones' decisions: the replacement of each module (``replaced``)
    and the norm each linear consumer shares (``norm_of``, by name). ``planning``: the kind whose changes are added
    now."""

    changes: list[Change] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    replaced: dict[nn.Module, nn.Module] = field(default_factory=dict)
    norm_of: dict[str, nn.Module] = field(default_factory=dict)
    linears: int = 0
    planning: str = ""

    def add(self, change: Change) -> None:
        self.changes.append(change)
        self.kinds.append(self.planning)

    def replace(self, old: nn.Module, new: nn.Module) -> None:
        self.add(Replace(old, new))
        self.replaced[old] = new

    def install(self, module: nn.Module, method: str, value: object) -> None:
        self.add(Install(module, method, value))

    def new_modules(self) -> list[nn.Module]:
        return list(self.replaced.values())

    def without(self, kinds: Iterable[str]) -> Plan:
        """This plan but the changes of ``kinds`` (their entries kept: the caller says what became of them)."""
        kept = [(change, kind) for change, kind in zip(self.changes, self.kinds) if kind not in set(kinds)]
        return replace(self, changes=[c for c, _ in kept], kinds=[k for _, k in kept])

    def apply(self, model: nn.Module, without: frozenset[str] = frozenset()) -> Surgery:
        """Apply every change but those of the kinds ``without``; returns the surgery that undoes them."""
        surgery = Surgery(model, self.new_modules())
        try:
            for change, kind in zip(self.changes, self.kinds):
                if kind not in without:
                    change.apply(surgery)
        except BaseException:
            surgery.rollback()
            raise
        return surgery
