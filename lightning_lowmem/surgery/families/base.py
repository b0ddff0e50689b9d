"""What every family of candidates shares: the :class:`Family` protocol and the :class:`Candidates` they find.

A family nominates its candidates (verified one by one, nothing changed) and, after the probe, plans their
:class:`~lightning_lowmem.surgery.changes.Change`\\ s and report entries. Families run in the order of
:data:`~lightning_lowmem.surgery.families.FAMILIES`, each seeing what the ones before it found and decided.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from lightning_lowmem.nn import LowMemLinear
from lightning_lowmem.registry.dropouts import is_elementwise_dropout
from lightning_lowmem.surgery import fsdp
from lightning_lowmem.surgery.identify import is_plain
from lightning_lowmem.surgery.report import Entry

if TYPE_CHECKING:
    from lightning_lowmem.surgery.changes import Plan
    from lightning_lowmem.surgery.options import Options
    from lightning_lowmem.surgery.probe import Flow

ROOT = "the model itself: modules are replaced in their parent, so convert a model that contains it"
"""Why the model itself is left alone: surgery replaces a module in its parent."""


@dataclass
class Candidates:
    """What the families found, by family kind (``found[kind]``: name -> what the family needs to plan it), and
    the cross-family facts: modules a family took (``claimed``: the activation inside a fused gated MLP; no other
    family may nominate them), dropouts folded into the linear computation reading them (``folded``: dropout ->
    (the linear layer taking it in, ``p``)), norms to probe (``norms``: name -> normalized shape), layers other than linear
    ones that share a norm's tensor when called on its output (``linear_readers``: LoRA layers whose forward the
    surgery installs, frozen 4-bit layers), the dropouts of adapters (``adapter_dropouts``: a norm read through
    one that is not folded is not shared), and report entries decided already."""

    by_kind: dict[str, dict[str, Any]] = field(default_factory=dict)
    claimed: set[str] = field(default_factory=set)
    folded: dict[str, tuple[str, float]] = field(default_factory=dict)
    norms: dict[str, tuple[int, ...]] = field(default_factory=dict)
    linear_readers: set[str] = field(default_factory=set)
    adapter_dropouts: set[str] = field(default_factory=set)
    kept_in_place: set[str] = field(default_factory=set)  # folded dropouts a rewritten forward reads p from
    entries: dict[str, Entry] = field(default_factory=dict)
    fsdp_owners: dict[str, nn.Module] = field(default_factory=dict)  # module name -> the FSDP2 module sharding it
    example: Any = None  # the input the surgery runs on (a family that checks a computation runs it)

    def __getitem__(self, kind: str) -> dict[str, Any]:
        return self.by_kind.setdefault(kind, {})

    def leave(self, name: str, kind: str, module: nn.Module, reason: str) -> None:
        self.entries[name] = Entry(name, kind, type(module).__name__, "left alone", reason)

    def already(self, name: str, kind: str, module: nn.Module) -> None:
        self.entries[name] = Entry(name, kind, type(module).__name__, "already converted", "")

    def gathered(self, name: str) -> AbstractContextManager[None]:
        """The parameters of the module ``name`` whole for the duration (an FSDP2-sharded module's are shards outside
        its block's forward), for a check that runs it."""
        return fsdp.gathered(self.fsdp_owners.get(name))

    def already_converted(self, name: str) -> bool:
        return name in self.entries and self.entries[name].status == "already converted"

    def taken(self, name: str) -> bool:
        """Whether ``name`` is decided already (an entry, claimed, or a folded dropout)."""
        return name in self.entries or name in self.claimed or name in self.folded

    def takes_dropout(self) -> dict[str, float]:
        """The linear layers that take in the dropout before them (a LoRA adapter's ``lora_A``, T5's ``wo``), with
        its probability."""
        return dict(self.folded.values())


def foldable(dropout: nn.Module, layer: nn.Module | None) -> bool:
    """Whether ``dropout`` can move into the linear ``layer`` that reads its output (``LowMemLinear(dropout=p)``)."""
    from_linear = type(layer) is nn.Linear or (isinstance(layer, LowMemLinear) and not layer.dropout)
    return is_elementwise_dropout(dropout) and dropout.p > 0 and from_linear and is_plain(layer) and is_plain(dropout)


class Family:
    """One family of candidates: ``kind`` names it in the report, ``switch`` is the option that turns it off;
    ``separable``: its changes can be undone alone (no other family's rely on them), so when the converted model
    saves more than the stock one this family alone can be rolled back if it is what costs."""

    kind: ClassVar[str]
    switch: ClassVar[str]
    separable: ClassVar[bool] = False

    def nominate(self, model: nn.Module, options: Options, found: Candidates) -> None:
        """Record the verified candidates in ``found[kind]``, and why others are left alone. Changes nothing."""

    def plan(self, model: nn.Module, found: Candidates, flow: Flow, options: Options, plan: Plan) -> None:
        """Add the changes and entries of this family's candidates to ``plan``."""

    def converted(self, module: nn.Module) -> bool:
        """Whether ``module`` is already this family's conversion (a second run reports it so)."""
        return False
