"""Activations a module's forward calls as functions (``F.silu(self.fc_1(x)) * self.fc_2(x)``: LitGPT's MLPs,
torchtitan's ``FeedForward``, nanoGPT's ``MLP``): that forward is rewritten to call the low-memory ops
(:mod:`lightning_lowmem.surgery.tracing`).

An activation call is a function of the registry (``F.gelu``, ``F.silu``, ``F.mish``: ``Activation.functions``)
whose other arguments are constants, or ``x * torch.sigmoid(x)``; which activation it computes is decided by
running it on the activation probe. When its output is only multiplied by another tensor, the two are a gated
product and fuse (:func:`~lightning_lowmem.nn.gated.gated_product`, sharing the product with the layer reading
it): a gated MLP found by its data flow, whatever its children are called. Any other call becomes its step op.
The family also reports the activations and training dropouts the probe saw called as functions elsewhere.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from lightning_lowmem.nn.adapters import adapter_of
from lightning_lowmem.nn.gated import gated_product
from lightning_lowmem.nn.rewritten import RewrittenForward, rewritten_forward_of
from lightning_lowmem.ops.activation import step_activation
from lightning_lowmem.registry.activations import FUNCTIONS, Activation
from lightning_lowmem.surgery.families.base import Candidates, Family
from lightning_lowmem.surgery.identify import NotConvertible, activation_of_function, is_plain
from lightning_lowmem.surgery.report import Entry
from lightning_lowmem.surgery.tracing import call_site, compiled, operand, trace

_PRODUCTS = (operator.mul, torch.mul)
_NAMES = frozenset({function.__name__ for function in FUNCTIONS} | {"sigmoid"})


def calls_activation_functions(module: nn.Module) -> bool:
    """Whether ``module``'s forward names an activation function (a cheap test before tracing it)."""
    code = getattr(type(module).forward, "__code__", None)
    return (
        code is not None and not _NAMES.isdisjoint(code.co_names) and not type(module).__module__.startswith("torch.")
    )


@dataclass(frozen=True)
class _Call:
    """An activation call in a traced forward: the node that outputs ``act(input)`` and every node computing it."""

    output: fx.Node
    input: fx.Node
    entry: Activation
    nodes: tuple[fx.Node, ...]
    spelled: str  # how the forward spells it, for the report


def _is_sigmoid_of(node: object, x: fx.Node) -> bool:
    is_sigmoid = isinstance(node, fx.Node) and (
        (node.op == "call_function" and node.target in (torch.sigmoid, F.sigmoid))
        or (node.op == "call_method" and node.target == "sigmoid")
    )
    return is_sigmoid and node.args == (x,) and not node.kwargs and len(node.users) == 1


def _activation_call(node: fx.Node) -> _Call | None:
    """The activation ``node`` computes, if it is a call of a registry function or ``x * sigmoid(x)``."""
    if node.op != "call_function":
        return None
    if node.target in FUNCTIONS and node.args and isinstance(node.args[0], fx.Node):
        rest, kwargs = node.args[1:], node.kwargs
        if any(isinstance(a, fx.Node) for a in (*rest, *kwargs.values())):
            return None
        entry = activation_of_function(lambda t: node.target(t, *rest, **kwargs))
        return None if entry is None else _Call(node, node.args[0], entry, (node,), f"F.{node.target.__name__}")
    if node.target in _PRODUCTS and len(node.args) == 2 and not node.kwargs:
        for sigmoid, x in (node.args, node.args[::-1]):
            if isinstance(x, fx.Node) and _is_sigmoid_of(sigmoid, x):
                entry = activation_of_function(lambda t: t * torch.sigmoid(t))
                return None if entry is None else _Call(node, x, entry, (node, sigmoid), "x * sigmoid(x)")
    return None


def _product_with(call: _Call) -> tuple[fx.Node, fx.Node] | None:
    """``(product node, other factor)`` when the activation's output is only multiplied by another tensor."""
    if len(call.output.users) != 1:
        return None
    product = next(iter(call.output.users))
    if product.op != "call_function" or product.target not in _PRODUCTS or len(product.args) != 2 or product.kwargs:
        return None
    other = product.args[1] if product.args[0] is call.output else product.args[0]
    activation = isinstance(other, fx.Node) and other is not call.output and other.op != "get_attr"
    return (product, other) if activation else None  # a product with a parameter (a scale) is no gated one


def _rewrite_call(
    graph: fx.Graph, call: _Call, gated: bool | str, bits: int | None, erased: set[fx.Node]
) -> str | None:
    """Replace ``call`` (fused with its product when ``gated``, saving gate and up when it is ``"exact"``; alone when
    ``bits`` is set), adding the nodes it removes to ``erased``; what changed, or None."""
    product = _product_with(call) if gated and call.entry.gated else None
    where = f"{call.spelled}({operand(call.input)})"
    if product is not None:
        node, up = product
        reader = next(iter(node.users)) if len(node.users) == 1 and gated != "exact" else None  # exact: keeps up
        consumer = reader.target if reader is not None and reader.op == "call_module" else None
        with graph.inserting_before(node):
            layer = graph.get_attr(consumer) if consumer is not None else None
            fused = graph.call_function(gated_product, (call.input, up, call.entry.name, layer))
        saves = f"gate, and up unless {consumer} saves the product" if consumer is not None else "gate and up"
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        erased.add(node)
        described = f"{where} * {operand(up)}: {call.entry.gated} fused, saves {saves}"
    elif bits is not None:
        try:
            call.entry.step_derivative(bits, "apply_lowmem")
        except ValueError as err:
            raise NotConvertible(str(err)) from None
        with graph.inserting_before(call.output):
            new = graph.call_function(step_activation, (call.input, call.entry.name, bits))
        call.output.replace_all_uses_with(new)
        described = f"{where}: {call.entry.label} with a {bits}-bit backward"
    else:
        return None
    for old in call.nodes:
        graph.erase_node(old)
        erased.add(old)
    return f"{described} ({call_site(call.output)})"


def rewrite(module: nn.Module, gated: bool | str, bits: int | None) -> RewrittenForward | None:
    """``module``'s forward with its activation calls replaced (gated products fused when ``gated``, other
    calls by their ``bits``-bit step op when ``bits`` is set), checked; ``None`` if it calls none; else
    :class:`NotConvertible`."""
    graph = trace(module, "calls activations as functions")
    sites, erased = [], set()
    for node in list(graph.nodes):
        call = _activation_call(node) if node not in erased else None
        site = _rewrite_call(graph, call, gated, bits, erased) if call is not None else None
        if site is not None:
            sites.append(site)
    if not sites:
        return None
    return RewrittenForward(module, compiled(module, graph), tuple(sites), any(" fused, " in site for site in sites))


class FunctionalActivations(Family):
    kind = "functional"
    switch = "activation"
    separable = True

    def converted(self, module: nn.Module) -> bool:
        return rewritten_forward_of(module) is not None and adapter_of(module) is None  # else a LoRA layer's

    def nominate(self, model, options, found: Candidates) -> None:
        """Modules whose forward calls activations as functions, with that forward rewritten; why the others'
        could not be (reported where the probe sees them call one: naming ``sigmoid`` proves no call)."""
        if not (options.activation or options.gated):
            return
        rewritten, unrewritten = found[self.kind], found["unrewritten"]
        for name, module in model.named_modules():
            if found.already_converted(name) or name in found["gated MLP"] or not options.selected(name):
                continue
            if module is model or not module._modules or not calls_activation_functions(module):
                continue  # the model's own forward may be running (deferred conversion); a leaf is one activation
            if not is_plain(module):
                unrewritten[name] = "has hooks or a patched forward (a rewritten forward would skip them)"
                continue
            try:
                with found.gathered(name):
                    forward = rewrite(module, options.gated, options.bits if options.activation else None)
            except NotConvertible as err:
                unrewritten[name] = str(err)
                continue
            if forward is not None:
                rewritten[name] = forward

    def plan(self, model, found, flow, options, plan) -> None:
        named = dict(model.named_modules())
        for name, forward in found[self.kind].items():
            plan.install(named[name], "forward", forward)
            kind = "gated MLP" if forward.fused else "activation"
            plan.entries.append(Entry(name, kind, type(named[name]).__name__, "converted", "; ".join(forward.sites)))
        for where, ops in flow.functional.items():
            if where in found[self.kind]:
                continue
            was = "F." + "/F.".join(sorted(ops))
            activation = not ops.isdisjoint(f.__name__ for f in FUNCTIONS)
            why = found["unrewritten"].get(where) if activation else None
            plan.entries.append(Entry(where, self.kind, was, "left alone", why or "called as a function, not a module"))


FAMILY = FunctionalActivations()
