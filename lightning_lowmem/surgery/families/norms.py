"""LayerNorm / RMSNorm (and registered norms): memory-sharing where linear layers read their output.

A norm is nominated by the registry and verified (:func:`~lightning_lowmem.surgery.identify.norm_spec`); after the
probe, its consumers are the linear layers reading its output that may save its normalized tensor instead (or it
stays, with the reason), and each consumer learns its norm (``plan.norm_of``) before the linear layers and
adapters are planned.
"""

from __future__ import annotations

from torch import nn

from lightning_lowmem.nn import LowMemLinear, LowMemTransposedLinear, MemorySharingNorm
from lightning_lowmem.nn.linear import share_functional_linears
from lightning_lowmem.registry.norms import NORMS
from lightning_lowmem.surgery.changes import AddHooks
from lightning_lowmem.surgery.families.base import ROOT, Candidates, Family
from lightning_lowmem.surgery.identify import (
    NormSpec,
    NotConvertible,
    composite_norm,
    is_plain,
    names_activation,
    names_norm,
    norm_spec,
)
from lightning_lowmem.surgery.probe import Flow
from lightning_lowmem.surgery.report import Entry


def _detail(name: str, spec: NormSpec, consumers: list[str], callers: list[str]) -> str:
    """E.g. ``MS-LN, shared with attn.qkv (its weight in F.linear in attn)`` (names relative to the norm's parent)."""
    kind = NORMS[spec.kind].converted_label
    parent = name.rpartition(".")[0] + "." if "." in name else ""
    detail = f"{kind}, shared with {', '.join(c.removeprefix(parent) for c in consumers)}"
    if callers:
        detail += f" (its weight in F.linear in {', '.join(c.removeprefix(parent) for c in callers)})"
    return detail


def _reads_linearly(found: Candidates, named: dict[str, nn.Module], folded: dict[str, float], where: str) -> bool:
    """Whether the module ``where`` reads a norm's output as a linear layer that may share it: a linear layer (not
    one an earlier run made another norm's consumer, unless a dropout folds into it: ``folded``), or a layer
    sharing as a whole (``found.linear_readers``)."""
    if where in found.linear_readers:
        return True
    if where not in found["linear"]:
        return False
    layer = named[where]
    earlier = isinstance(layer, (LowMemLinear, LowMemTransposedLinear)) and layer.norm is not None
    return not earlier or where in folded


def decide_consumers(model: nn.Module, found: Candidates, flow: Flow, options) -> None:
    """Each traced norm's consumers in ``flow``, or its reason to be left alone (a linear reads the last
    dimension: a norm's affine must be over that one)."""
    named = dict(model.named_modules())
    for name, spec in found["norm"].items():
        if len(spec.normalized_shape) > 1:
            flow.block(name, f"normalized over {len(spec.normalized_shape)} dimensions, its linear readers over one")
        elif name not in flow.blocked:
            _decide_consumers(name, flow, found, named, options)


def _decide_consumers(norm: str, flow: Flow, found: Candidates, named: dict[str, nn.Module], options) -> None:
    """The linear layers reading ``norm``'s output that become its consumers, or the norm's reason to be left
    alone. A linear layer is called on the output, or its weight is used by ``F.linear`` on it in another
    module's forward (that module then shares through :func:`~lightning_lowmem.nn.linear.share_functional_linears`).
    An excluded or hooked one stays stock and reads the stock output."""
    reads, folded = flow.reads[norm], found.takes_dropout()
    called = [r.where for r in reads if r.op is None and _reads_linearly(found, named, folded, r.where)]
    linears = found["linear"]
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


class Norms(Family):
    kind = "norm"
    switch = "norm"

    def converted(self, module: nn.Module) -> bool:
        return isinstance(module, MemorySharingNorm)

    def nominate(self, model, options, found: Candidates) -> None:
        for name, module in model.named_modules():
            if found.taken(name) or not options.selected(name):
                continue
            if options.norm and (composite := composite_norm(module)) is not None:
                found.leave(name, self.kind, module, composite)
            if not names_norm(module) or names_activation(module):
                continue
            if module is model:
                found.leave(name, self.kind, module, ROOT)
            elif options.norm:
                try:
                    found[self.kind][name] = spec = norm_spec(module)
                    found.norms[name] = spec.normalized_shape
                except NotConvertible as err:
                    found.leave(name, self.kind, module, str(err))

    def plan(self, model, found, flow, options, plan) -> None:
        decide_consumers(model, found, flow, options)
        named = dict(model.named_modules())
        hooked: set[str] = set()
        for name, spec in found[self.kind].items():
            stock = named[name]
            if name in flow.blocked:
                plan.entries.append(Entry(name, self.kind, type(stock).__name__, "left alone", flow.blocked[name]))
                continue
            new = MemorySharingNorm.of_kind(spec.kind)(
                spec.normalized_shape, spec.eps, weight_offset=spec.weight_offset
            )
            new.adopt(stock, spec.weight_name, spec.bias_name)
            consumers, callers = sorted(flow.consumers[name]), flow.functional_callers[name]
            plan.norm_of.update(dict.fromkeys(consumers, new))
            for caller in callers:
                if caller not in hooked:
                    hooked.add(caller)
                    plan.add(AddHooks(named[caller], share_functional_linears))
            plan.replace(stock, new)
            plan.entries.append(
                Entry(name, self.kind, type(stock).__name__, "converted", _detail(name, spec, consumers, callers))
            )


FAMILY = Norms()
