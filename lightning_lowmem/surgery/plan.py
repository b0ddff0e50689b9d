"""The plan stage: from the verified candidates and the probe's reads, every replacement and report entry.

A norm gets consumers (the linear layers that read its output and may save its normalized tensor
instead) or the reason it is left alone; every candidate that passed gets its replacement module.
Nothing here changes the model: :mod:`.convert` applies the plan, all or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from lightning_lowmem.nn import (
    GatedMLPBase,
    LowMemActivation,
    LowMemLinear,
    LowMemTransposedLinear,
    MemorySharingNorm,
    SeededDropout,
)
from lightning_lowmem.nn.causal_lm import FusedLossForward
from lightning_lowmem.nn.litgpt import AttentionLayout, LoRAForward
from lightning_lowmem.registry.activations import ACTIVATIONS
from lightning_lowmem.registry.norms import NORMS
from lightning_lowmem.surgery.bitsandbytes import is_frozen_4bit_linear
from lightning_lowmem.surgery.functional import FUNCTIONS
from lightning_lowmem.surgery.identify import LinearKind, NormSpec, is_plain
from lightning_lowmem.surgery.nominate import LOW_MEMORY_LINEARS, Candidates
from lightning_lowmem.surgery.options import Options
from lightning_lowmem.surgery.probe import Flow
from lightning_lowmem.surgery.report import Entry, EntryKind

_LOW_MEMORY_LINEARS: dict[LinearKind, type[LowMemLinear | LowMemTransposedLinear]] = {
    cls.linear_kind: cls for cls in LOW_MEMORY_LINEARS
}


def decide_consumers(model: nn.Module, found: Candidates, flow: Flow, options: Options) -> None:
    """Each traced norm's consumers in ``flow``, or its reason to be left alone (a linear reads the last
    dimension: a norm's affine must be over that one)."""
    named = dict(model.named_modules())
    for name, spec in found.norms.items():
        if len(spec.normalized_shape) > 1:
            flow.block(name, f"normalized over {len(spec.normalized_shape)} dimensions, its linear readers over one")
        elif name not in flow.blocked:
            _decide_consumers(name, flow, found.linears, set(found.litgpt_lora), named, options)


def _decide_consumers(
    norm: str,
    flow: Flow,
    linears: dict[str, LinearKind],
    lora_layers: set[str],
    named: dict[str, nn.Module],
    options: Options,
) -> None:
    """The linear layers reading ``norm``'s output that become its consumers, or the norm's reason to be left
    alone. A linear layer is called on the output, or its weight is used by ``F.linear`` on it in another
    module's forward (that module then shares through :func:`~lightning_lowmem.nn.linear.share_functional_linears`).
    An excluded or hooked one stays stock and reads the stock output. A frozen 4-bit linear (QLoRA's base layer)
    is a consumer as it is: it saves nothing. A LitGPT LoRA layer is one through its adapter's ``x @ A.T``."""
    reads = flow.reads[norm]
    reads_linearly = lambda where: where in linears or where in lora_layers or is_frozen_4bit_linear(named[where])
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
    methods: dict[tuple[nn.Module, str], object] = field(default_factory=dict)  # (module, method) -> installed
    entries: list[Entry] = field(default_factory=list)
    linears: int = 0


def _norm_detail(name: str, spec: NormSpec, consumers: list[str], callers: list[str]) -> str:
    """E.g. ``MS-LN, shared with attn.qkv (its weight in F.linear in attn)`` (names relative to the norm's parent)."""
    kind = NORMS[spec.kind].converted_label
    parent = name.rpartition(".")[0] + "." if "." in name else ""
    detail = f"{kind}, shared with {', '.join(c.removeprefix(parent) for c in consumers)}"
    if callers:
        detail += f" (its weight in F.linear in {', '.join(c.removeprefix(parent) for c in callers)})"
    return detail


_ATTENTION_DETAIL = "v compact and q as (B, T, H, D): SDPA holds no qkv output, proj reads the output it saves"
_HEAD_DETAIL = "training loss through the fused linear + cross-entropy (no logits; logits None with labels)"


def _relative(name: str, to: str) -> str:
    """``name`` without the module path it shares with ``to`` (``q_proj.lora_A.default`` seen from
    ``q_proj.lora_dropout.default``: ``lora_A.default``)."""
    parts, base = name.split("."), to.split(".")
    common = next((i for i, (a, b) in enumerate(zip(parts, base)) if a != b), min(len(parts), len(base)))
    return ".".join(parts[common:])


def _gated_detail(new: GatedMLPBase) -> str:
    """E.g. ``SwiGLU fused, saves gate (+ the product its down projection saves)``."""
    saves = "gate (+ the product its down projection saves)" if new.resolved_mode() == "gate" else "gate and up"
    return f"{ACTIVATIONS[new.activation].gated} fused, saves {saves}"


def make_plan(model: nn.Module, found: Candidates, flow: Flow, options: Options) -> Plan:
    """Decide each norm's consumers, then build the replacement of every candidate that passed, and the entries
    of all of them."""
    decide_consumers(model, found, flow, options)
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
        new = MemorySharingNorm.of_kind(spec.kind)(spec.normalized_shape, spec.eps, weight_offset=spec.weight_offset)
        new.adopt(stock, spec.weight_name, spec.bias_name)
        consumers, callers = sorted(flow.consumers[name]), flow.functional_callers[name]
        norm_of.update(dict.fromkeys(consumers, new))
        plan.functional_callers += [named[c] for c in callers if named[c] not in plan.functional_callers]
        replace(name, "norm", new, _norm_detail(name, spec, consumers, callers))
    folded = found.takes_dropout()
    for name, kind in found.linears.items():
        module = named[name]
        recasts = isinstance(module, LOW_MEMORY_LINEARS)  # converted by an earlier run
        recast = options.linear and options.selected(name) and is_plain(module) and not recasts
        if name in norm_of or name in folded or recast:
            norm = norm_of.get(name, module.norm if recasts else None)
            dropout = {"dropout": folded[name]} if name in folded else {}  # LowMemLinear's alone: nn.Linear's
            plan.replacements[module] = _LOW_MEMORY_LINEARS[kind].from_linear(module, norm, **dropout)
            plan.linears += not recasts
    for name, p in found.litgpt_lora.items():
        plan.methods[named[name], "forward"] = LoRAForward(named[name], norm_of.get(name), p)
    for name in found.litgpt_attention:
        plan.methods[named[name], "scaled_dot_product_attention"] = AttentionLayout(named[name])
        plan.entries.append(Entry(name, "attention", type(named[name]).__name__, "converted", _ATTENTION_DETAIL))
    for name, rewritten in found.rewritten.items():
        plan.methods[named[name], "forward"] = rewritten
        kind: EntryKind = "gated MLP" if rewritten.fused else "activation"
        plan.entries.append(Entry(name, kind, type(named[name]).__name__, "converted", "; ".join(rewritten.sites)))
    for name, p in found.dropouts.items():
        replace(
            name, "dropout", SeededDropout.from_module(named[name]), f"seeded (p={p:g}): saves its seed, not its mask"
        )
    for name, (layer, p) in found.folded.items():
        detail = f"folded into {_relative(layer, name)} (p={p:g}): it saves its input and a seed, not a dropped copy"
        replace(name, "dropout", nn.Identity(), detail)
    for name in found.heads:
        head = named[name].get_output_embeddings()
        fused = FusedLossForward(named[name], plan.replacements.get(head, head))
        plan.methods.update({(named[name], "forward"): fused, (fused.head, "forward"): fused.head_forward})
        plan.entries.append(Entry(name, "head", type(named[name]).__name__, "converted", _HEAD_DETAIL))
    for where, ops in flow.functional.items():
        if where in found.rewritten:
            continue
        was = "F." + "/F.".join(sorted(ops))
        activation = not ops.isdisjoint(f.__name__ for f in FUNCTIONS)
        why = found.unrewritten.get(where) if activation else None
        plan.entries.append(Entry(where, "functional", was, "left alone", why or "called as a function, not a module"))
    order = {name: i for i, name in enumerate(named)}
    plan.entries.sort(key=lambda e: (order.get(e.name, len(order)), e.kind))
    return plan
