"""The deciding phases of model surgery: options -> candidates -> (data flow) -> plan.

Nothing here changes the model. :func:`nominate` finds and verifies candidates (gated MLPs
first, so the activations inside the ones that fuse are theirs); :func:`trace_norms` proves
where each norm's output goes; :func:`make_plan` builds every replacement module and the
report entries. :mod:`.convert` then applies the plan, all or nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from lightning_lowmem.nn import (
    GatedMLPBase,
    LowMemActivation,
    LowMemLinear,
    LowMemTransposedLinear,
    MemorySharingNorm,
    MSLayerNorm,
    MSRMSNorm,
)
from lightning_lowmem.ops.activation_registry import check_bits
from lightning_lowmem.surgery import dataflow
from lightning_lowmem.surgery.detect import (
    LinearKind,
    LinearLayers,
    NormSpec,
    NotConvertible,
    activation_name,
    fused_gated_mlp,
    gated_layout,
    is_activation_candidate,
    is_frozen_4bit_linear,
    is_norm_candidate,
    is_plain,
    norm_spec,
)
from lightning_lowmem.surgery.report import Entry, EntryKind

_CONVERTED: dict[type[nn.Module], EntryKind] = {
    LowMemActivation: "activation",
    GatedMLPBase: "gated MLP",
    MemorySharingNorm: "norm",
}
_GATED_NAMES = {"silu": "SwiGLU", "gelu": "GeGLU", "gelu_tanh": "GeGLU (tanh)"}
_LOW_MEMORY_LINEARS: dict[LinearKind, type[LowMemLinear | LowMemTransposedLinear]] = {
    "linear": LowMemLinear,
    "transposed": LowMemTransposedLinear,
}


class ExampleInputError(RuntimeError):
    """The model fails on the example input (the model's own error is the cause); nothing was changed."""


def _enabled(option: Any, name: str) -> bool:
    if option in ("auto", True):
        return True
    if option in (False, None, "off"):
        return False
    raise ValueError(f"apply_lowmem: {name} must be 'auto', True, False or 'off', got {option!r}")


def _patterns(option: str | Sequence[str] | None) -> tuple[str, ...]:
    return (option,) if isinstance(option, str) else tuple(option or ())


@dataclass(frozen=True)
class Options:
    """The validated options of :func:`~lightning_lowmem.apply_lowmem`."""

    activation: bool = True
    norm: bool = True
    linear: bool = True
    gated: bool = True
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    bits: int = 2
    budget_mib: float | None = None
    checkpoint: tuple[str, ...] = ()

    @classmethod
    def parse(
        cls,
        model: nn.Module,
        *,
        activation: str | bool = "auto",
        norm: str | bool = "auto",
        linear: str | bool = "auto",
        gated: str | bool = "auto",
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        bits: int = 2,
        budget_mib: float | None = None,
        checkpoint: str | Sequence[str] | None = None,
    ) -> Options:
        """Validate every option up front: a typo fails before anything runs."""
        if budget_mib is not None and (isinstance(budget_mib, bool) or not isinstance(budget_mib, (int, float))):
            raise ValueError(f"apply_lowmem: budget_mib must be a number of MiB, got {budget_mib!r}")
        if budget_mib is not None and not budget_mib > 0:
            raise ValueError(f"apply_lowmem: budget_mib must be positive, got {budget_mib!r}")
        options = cls(
            _enabled(activation, "activation"), _enabled(norm, "norm"), _enabled(linear, "linear"),
            _enabled(gated, "gated"), _patterns(include), _patterns(exclude), check_bits("apply_lowmem", bits),
            budget_mib, _patterns(checkpoint),
        )  # fmt: skip
        names = [name for name, _ in model.named_modules()]
        for pattern in options.include + options.exclude + options.checkpoint:
            if not any(fnmatchcase(name, pattern) for name in names):
                raise ValueError(f"apply_lowmem: pattern {pattern!r} matches no module of {type(model).__name__}")
        return options

    @property
    def needs_input(self) -> bool:
        """Whether the surgery needs a real input: to trace the norms, or to fit a budget."""
        return self.norm or self.budget_mib is not None

    def excluded(self, name: str) -> bool:
        return any(fnmatchcase(name, p) for p in self.exclude)

    def selected(self, name: str) -> bool:
        return (not self.include or any(fnmatchcase(name, p) for p in self.include)) and not self.excluded(name)


@dataclass
class Candidates:
    """Verified candidates by module name, and the entries of those already decided."""

    activations: dict[str, str] = field(default_factory=dict)  # -> activation registry name
    norms: dict[str, NormSpec] = field(default_factory=dict)
    gated: dict[str, GatedMLPBase] = field(default_factory=dict)  # -> its verified fused replacement
    linears: dict[str, LinearKind] = field(default_factory=dict)  # every linear layer not yet low-memory
    entries: dict[str, Entry] = field(default_factory=dict)


def _already_converted(name: str, module: nn.Module) -> Entry | None:
    for cls, kind in _CONVERTED.items():
        if isinstance(module, cls):
            return Entry(name, kind, type(module).__name__, "already converted", "")
    return None


# Surgery replaces a module in its parent; the model itself has none to be replaced in.
_ROOT = "the model itself: modules are replaced in their parent, so convert a model that contains it"


def nominate(model: nn.Module, options: Options) -> Candidates:
    """Find and verify every candidate module; left-alone ones get their reason."""
    found = Candidates()
    named = dict(model.named_modules())
    fused_activations: set[str] = set()
    linear_layers = LinearLayers()
    for name, module in named.items():
        layout = gated_layout(module) if options.gated and options.selected(name) else None
        if layout is None:
            continue
        if module is model:
            found.entries[name] = Entry(name, "gated MLP", type(module).__name__, "left alone", _ROOT)
            continue
        try:
            found.gated[name] = fused_gated_mlp(module, layout)
            fused_activations.add(f"{name}.{layout.activation}")
        except NotConvertible as err:
            found.entries[name] = Entry(name, "gated MLP", type(module).__name__, "left alone", str(err))
    for name, module in named.items():
        kind = None if isinstance(module, tuple(_LOW_MEMORY_LINEARS.values())) else linear_layers.kind(module)
        if kind is not None:
            found.linears[name] = kind
        done = _already_converted(name, module)
        if done is not None:
            found.entries[name] = done
        elif name in fused_activations or not options.selected(name):
            continue
        elif module is model and (is_activation_candidate(module) or is_norm_candidate(module)):
            kind = "activation" if is_activation_candidate(module) else "norm"
            found.entries[name] = Entry(name, kind, type(module).__name__, "left alone", _ROOT)
        elif options.activation and is_activation_candidate(module):
            try:
                found.activations[name] = activation_name(module)
            except NotConvertible as err:
                found.entries[name] = Entry(name, "activation", type(module).__name__, "left alone", str(err))
        elif options.norm and is_norm_candidate(module):
            try:
                found.norms[name] = norm_spec(module)
            except NotConvertible as err:
                found.entries[name] = Entry(name, "norm", type(module).__name__, "left alone", str(err))
    return found


def trace_norms(model: nn.Module, example: Any, found: Candidates, options: Options) -> dataflow.Flow:
    """Which linear layers read each norm's output and may save its normalized tensor instead."""
    named = dict(model.named_modules())
    if example is None:
        flow = dataflow.Flow()
        for name in found.norms:
            flow.block(name, "no example input to trace its data flow (set example_input_array)")
        return flow
    activations = {m for m in named.values() if is_activation_candidate(m) or isinstance(m, tuple(_CONVERTED))}
    try:
        norms = {n: (named[n], spec.normalized_shape) for n, spec in found.norms.items()}
        flow = dataflow.trace(model, example, norms, activations)
    except Exception as err:
        raise ExampleInputError(
            f"apply_lowmem: {type(model).__name__} cannot run the example input ({type(err).__name__}: {err}); "
            "nothing was changed"
        ) from err
    for name, spec in found.norms.items():  # a linear reads the last dimension: its affine must be over that one
        if len(spec.normalized_shape) > 1:
            flow.block(name, f"normalized over {len(spec.normalized_shape)} dimensions, its linear readers over one")
        elif name not in flow.blocked:
            _decide_consumers(name, flow, found.linears, named, options)
    return flow


def _decide_consumers(
    norm: str, flow: dataflow.Flow, linears: dict[str, LinearKind], named: dict[str, nn.Module], options: Options
) -> None:
    """The linear layers reading ``norm``'s output that become its consumers, or the norm's reason to be left
    alone. A linear layer is called on the output, or its weight is used by ``F.linear`` on it in another
    module's forward (that module then shares through :func:`~lightning_lowmem.nn.linear.share_functional_linears`).
    An excluded or hooked one stays stock and reads the stock output. A frozen 4-bit linear (QLoRA's base layer)
    is a consumer as it is: it saves nothing."""
    reads = flow.reads[norm]
    reads_linearly = lambda where: where in linears or is_frozen_4bit_linear(named[where])
    called = [r.where for r in reads if r.op is None and reads_linearly(r.where)]
    functional = [
        r for r in reads if r.op == "linear" and linears.get(r.weight_of) == "linear" and not options.excluded(r.where)
    ]
    linear = called + [r.weight_of for r in functional]
    keep = lambda layer: not options.excluded(layer) and is_plain(named[layer])
    flow.consumers[norm] = [c for c in dict.fromkeys(linear) if keep(c)]
    flow.functional_callers[norm] = sorted({r.where for r in functional if keep(r.weight_of)})
    if flow.consumers[norm]:
        return
    if linear:
        why = "is excluded" if options.excluded(linear[0]) else "has hooks or a patched forward"
        flow.block(norm, f"its only linear readers stay stock (consumer {linear[0]} {why})")
    else:
        first = next((f" (first read by {r.describe()})" for r in reads), "")
        flow.block(norm, "no linear layer reads its output" + first)


@dataclass
class Plan:
    """Every replacement (old module -> new module), the modules whose own ``F.linear`` calls must share
    (:func:`~lightning_lowmem.nn.linear.share_functional_linears`), and the report entries."""

    replacements: dict[nn.Module, nn.Module] = field(default_factory=dict)
    functional_callers: list[nn.Module] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    linears: int = 0


def _norm_detail(name: str, spec: NormSpec, consumers: list[str], callers: list[str]) -> str:
    """E.g. ``MS-LN, shared with attn.qkv (its weight in F.linear in attn)`` (names relative to the norm's parent)."""
    kind = "MS-LN" if spec.kind == "layer" else "MS-RMSNorm"
    parent = name.rpartition(".")[0] + "." if "." in name else ""
    detail = f"{kind}, shared with {', '.join(c.removeprefix(parent) for c in consumers)}"
    if callers:
        detail += f" (its weight in F.linear in {', '.join(c.removeprefix(parent) for c in callers)})"
    return detail


def _gated_detail(new: GatedMLPBase) -> str:
    """E.g. ``SwiGLU fused, saves gate (+ the product its down projection saves)``."""
    saves = "gate (+ the product its down projection saves)" if new.resolved_mode() == "gate" else "gate and up"
    return f"{_GATED_NAMES[new.activation]} fused, saves {saves}"


def make_plan(model: nn.Module, found: Candidates, flow: dataflow.Flow, options: Options) -> Plan:
    """Build the replacement of every candidate that passed, and the entries of all of them."""
    plan = Plan(entries=list(found.entries.values()))
    named = dict(model.named_modules())

    def replace(name: str, kind: EntryKind, new: nn.Module, detail: str) -> None:
        plan.replacements[named[name]] = new
        plan.entries.append(Entry(name, kind, type(named[name]).__name__, "converted", detail))

    for name, fused in found.gated.items():
        replace(name, "gated MLP", fused, _gated_detail(fused))
    for name, activation in found.activations.items():
        new = LowMemActivation.create(activation, options.bits)
        replace(name, "activation", new, new.label)
    norm_of: dict[str, MemorySharingNorm] = {}  # consumer linear name -> its norm
    for name, spec in found.norms.items():
        stock = named[name]
        if name in flow.blocked:
            plan.entries.append(Entry(name, "norm", type(stock).__name__, "left alone", flow.blocked[name]))
            continue
        cls = MSLayerNorm if spec.kind == "layer" else MSRMSNorm
        new = cls(spec.normalized_shape, spec.eps, weight_offset=spec.weight_offset)
        new.weight, new.bias = stock._parameters.get("weight"), stock._parameters.get("bias")
        consumers, callers = sorted(flow.consumers[name]), flow.functional_callers[name]
        norm_of.update(dict.fromkeys(consumers, new))
        plan.functional_callers += [named[c] for c in callers if named[c] not in plan.functional_callers]
        replace(name, "norm", new, _norm_detail(name, spec, consumers, callers))
    for name, kind in found.linears.items():
        module = named[name]
        if name in norm_of or (options.linear and options.selected(name) and is_plain(module)):
            plan.replacements[module] = _LOW_MEMORY_LINEARS[kind].from_linear(module, norm=norm_of.get(name))
            plan.linears += 1
    for where, ops in flow.functional.items():
        was = "F." + "/F.".join(sorted(ops))
        plan.entries.append(Entry(where, "functional", was, "left alone", "called as a function, not a module"))
    order = {name: i for i, name in enumerate(named)}
    plan.entries.sort(key=lambda e: (order.get(e.name, len(order)), e.kind))
    return plan
