"""Hand-written LoRA layers, found by their data flow: a module whose forward computes
``linear(x) + scale * B(A(dropout(x)))`` (research code's adapters, torchtune's ``LoRALinear``), with ``A`` and
``B`` linear children or Parameters (``x @ A.T``, ``x @ A``, ``F.linear(x, A)``), however they are called.

Its forward, traced one level deep (:mod:`lightning_lowmem.surgery.tracing`), is rewritten so that ``A(dropout(x))``
is :func:`~lightning_lowmem.nn.adapters.dataflow.adapter_input`: the adapter saves ``x`` (a memory-sharing norm's
``z`` when ``x`` is its output, for the layer reads linearly) and a seed, never a dropped copy; the dropout stays
where it is, and the rewritten forward reads its ``p``. Checked against the stock forward on a random input,
reported by call site.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from lightning_lowmem.nn.adapters import adapter_of
from lightning_lowmem.nn.adapters.dataflow import RECORD, LoRARecord, adapter_input
from lightning_lowmem.nn.rewritten import RewrittenForward
from lightning_lowmem.registry.dropouts import is_elementwise_dropout
from lightning_lowmem.surgery.families.base import Candidates, Family
from lightning_lowmem.surgery.identify import NotConvertible, is_plain
from lightning_lowmem.surgery.report import Entry
from lightning_lowmem.surgery.tracing import call_site, compiled, trace

_ADDS = (operator.add, torch.add)
_PRODUCTS = (operator.mul, torch.mul)
_MATMULS = (operator.matmul, torch.matmul)


@dataclass(frozen=True)
class _Product:
    """``x @ weight.T`` in a graph: the node computing it, its input, and how to read the weight as ``F.linear``'s
    (a Parameter's qualified name, and whether the graph holds it transposed)."""

    node: fx.Node
    input: fx.Node
    weight: str
    transposed: bool
    bias: str | None = None


@dataclass(frozen=True)
class _Site:
    base: _Product
    a: _Product
    b: _Product
    dropout: str | None  # the dropout child between x and A
    add: fx.Node


def _parameter(node: object, module: nn.Module) -> tuple[str, bool] | None:
    """``(name, transposed)`` when ``node`` is a 2-d Parameter of ``module`` (``get_attr``), or its transpose."""
    if not isinstance(node, fx.Node):
        return None
    transposed = False
    if (node.op == "call_method" and node.target in ("t", "transpose") and node.args[1:] in ((), (0, 1), (1, 0), (-1, -2), (-2, -1))) or (
        node.op == "call_function" and node.target is getattr and node.args[1:] == ("T",)
    ):  # fmt: skip
        node, transposed = node.args[0], True
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    try:
        parameter = module.get_parameter(node.target)
    except AttributeError:
        return None
    return (node.target, transposed) if parameter.dim() == 2 else None


def _product(node: object, module: nn.Module) -> _Product | None:
    """``node`` as a linear product of its input: a plain linear child called on it, ``F.linear`` with a Parameter,
    or a matmul by a Parameter (``x @ A.T``: as ``F.linear``'s weight ``A``; ``x @ A``: ``A`` transposed)."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_module":
        child = module.get_submodule(node.target)
        if type(child) is nn.Linear and is_plain(child) and len(node.args) == 1 and not node.kwargs:
            bias = None if child.bias is None else f"{node.target}.bias"
            return _Product(node, node.args[0], f"{node.target}.weight", False, bias)
        return None
    if node.op == "call_function" and node.target is F.linear and len(node.args) in (2, 3) and not node.kwargs:
        found, bias = _parameter(node.args[1], module), node.args[2] if len(node.args) == 3 else None
        if found is None or found[1] or not (bias is None or (isinstance(bias, fx.Node) and bias.op == "get_attr")):
            return None
        return _Product(node, node.args[0], found[0], False, None if bias is None else bias.target)
    if node.op == "call_function" and node.target in _MATMULS and len(node.args) == 2:
        found = _parameter(node.args[1], module)
        return None if found is None else _Product(node, node.args[0], found[0], not found[1])
    return None


def _unscaled(node: object) -> object:
    """``node`` without multiplications by constants (the LoRA scale, on either side)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _PRODUCTS:
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        if len(tensors) != 1 or node.kwargs:
            return node
        node = tensors[0]
    return node


def _find(graph: fx.Graph, module: nn.Module) -> _Site | None:
    """The LoRA computation of ``module``'s traced forward, if it has one (read from its single input)."""
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if not inputs:
        return None
    x = inputs[0]
    for add in graph.nodes:
        if add.op != "call_function" or add.target not in _ADDS or len(add.args) != 2:
            continue
        for base_node, lora_node in (add.args, add.args[::-1]):
            base, b = _product(base_node, module), _product(_unscaled(lora_node), module)
            a = _product(_unscaled(b.input), module) if b is not None else None
            if base is None or a is None or base.input is not x or len(a.node.users) != 1:
                continue
            if a.input is x:
                return _Site(base, a, b, None, add)
            dropped = a.input
            if dropped.op == "call_module" and dropped.args == (x,) and len(dropped.users) == 1:
                child = module.get_submodule(dropped.target)
                if is_elementwise_dropout(child) or type(child) is nn.Identity:
                    return _Site(base, a, b, dropped.target, add)
    return None


def _spelled(site: _Site) -> str:
    """``linear(x) + scale * lora_b(lora_a(dropout(x)))`` in the names of the module's parts."""
    name = lambda product: product.weight.removesuffix(".weight")
    inner = f"{site.dropout}(x)" if site.dropout else "x"
    return f"{name(site.base)}(x) + scale * {name(site.b)}({name(site.a)}({inner}))"


def _rewrite(module: nn.Module, fold: bool) -> tuple[RewrittenForward, _Site] | None:
    """``module``'s forward with its adapter's ``A(dropout(x))`` as :func:`adapter_input` (the dropout taken in
    when ``fold``), checked; ``None`` when it computes no LoRA; else :class:`NotConvertible`."""
    graph = trace(module, "computes a LoRA adapter")
    site = _find(graph, module)
    if site is None:
        return None
    a, x = site.a, site.base.input
    with graph.inserting_before(a.node):
        weight = graph.get_attr(a.weight)
        if a.transposed:
            weight = graph.call_method("t", (weight,))
        bias = graph.get_attr(a.bias) if a.bias else None
        dropout = graph.get_attr(site.dropout) if site.dropout and fold else None
        new = graph.call_function(adapter_input, (x if fold else a.input, weight, bias, dropout))
    a.node.replace_all_uses_with(new)
    graph.erase_node(a.node)
    if fold and site.dropout:
        graph.erase_node(a.input)  # the dropout's call: the adapter takes it in
    width = module.get_parameter(a.weight).shape[0 if a.transposed else 1]
    described = f"{_spelled(site)} ({call_site(site.add)})"
    return RewrittenForward(module, compiled(module, graph, width), (described,), False), site


def _chain(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether matrices of shapes ``a`` then ``b`` chain through a dimension smaller than their others, as ``A`` and
    ``B`` do: ``(r, in)`` then ``(out, r)`` (``F.linear``'s), or ``(in, r)`` then ``(r, out)``."""
    return (a[0] == b[1] and a[0] < min(a[1], b[0])) or (a[1] == b[0] and a[1] < min(a[0], b[1]))


def _may_be_lora(module: nn.Module) -> bool:
    """A cheap test before tracing: a class outside torch holding at least three matrices (its own Parameters or
    its plain linear children's weights), two of which chain as ``A`` and ``B`` do."""
    if type(module).__module__.startswith("torch.") or adapter_of(module) is not None:
        return False
    shapes = [tuple(p.shape) for p in module.parameters(recurse=False) if p.dim() == 2]
    shapes += [tuple(c.weight.shape) for c in module.children() if type(c) is nn.Linear]
    return len(shapes) >= 3 and any(_chain(a, b) for i, a in enumerate(shapes) for j, b in enumerate(shapes) if i != j)


class LoRAByDataFlow(Family):
    kind = "LoRA"
    switch = "lora"

    def nominate(self, model, options, found: Candidates) -> None:
        for name, module in model.named_modules():
            if module is model or found.taken(name) or not options.lora or not options.selected(name):
                continue
            if name in found["gated MLP"] or name in found["functional"]:
                continue
            if not _may_be_lora(module) or not is_plain(module):
                continue
            try:
                with found.gathered(name):
                    rewritten = _rewrite(module, options.dropout)
            except NotConvertible:
                continue  # a module that traces badly and may compute no LoRA at all: nothing to report
            if rewritten is None:
                continue
            forward, site = rewritten
            found["hand-written LoRA"][name] = (forward, LoRARecord(site.base.weight, site.a.weight))
            found.linear_readers.add(name)
            dropout = module.get_submodule(site.dropout) if site.dropout else None
            if options.dropout and dropout is not None and is_elementwise_dropout(dropout) and dropout.p > 0:
                dropout_name = f"{name}.{site.dropout}"
                found.folded[dropout_name] = (f"{name}.{site.a.weight.removesuffix('.weight')}", dropout.p)
                found.kept_in_place.add(dropout_name)

    def plan(self, model, found, flow, options, plan) -> None:
        named = dict(model.named_modules())
        for name, (forward, record) in found["hand-written LoRA"].items():
            plan.install(named[name], "forward", forward)
            plan.install(named[name], RECORD, record)
            saves = "the norm's z" if name in plan.norm_of else "its input"
            detail = f"{forward.sites[0]}: A saves {saves} and a seed, never a dropped copy"
            plan.entries.append(Entry(name, self.kind, type(named[name]).__name__, "converted", detail))


FAMILY = LoRAByDataFlow()
