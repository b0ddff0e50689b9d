"""Activations a module's forward calls as functions (``F.silu(self.fc_1(x)) * self.fc_2(x)``: LitGPT's MLPs,
torchtitan's ``FeedForward``, nanoGPT's ``MLP``): that forward, traced one level deep by torch.fx (the module's
children are leaves, called as they are), is rewritten to call the low-memory ops and installed on the module
(:class:`~lightning_lowmem.nn.rewritten.RewrittenForward`; the module keeps its class and children).

An activation call is a function of the registry (``F.gelu``, ``F.silu``, ``F.mish``: ``Activation.functions``)
whose other arguments are constants, or ``x * torch.sigmoid(x)``; which activation it computes is decided by
running it on the activation probe. When its output is only multiplied by another tensor, the two are a gated
product and fuse (:func:`~lightning_lowmem.nn.gated.gated_product`, sharing the product with the layer reading
it): a gated MLP found by its data flow, whatever its children are called. Any other call becomes its step op.
Tracing takes the module's attributes as they are (``self.config.gelu_approximate``), so a forward that reads
``self.training`` is left alone, and the rewritten forward must compute what the stock one does on a random input.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import fx, nn

from lightning_lowmem.nn.gated import gated_product
from lightning_lowmem.nn.rewritten import RewrittenForward
from lightning_lowmem.ops.activation import step_activation
from lightning_lowmem.registry.activations import ACTIVATIONS, Activation
from lightning_lowmem.surgery.example import probe_mode
from lightning_lowmem.surgery.identify import NotConvertible, activation_of_function

FUNCTIONS = frozenset(function for entry in ACTIVATIONS.values() for function in entry.functions)
_PRODUCTS = (operator.mul, torch.mul)
_TORCH = str(Path(torch.__file__).parent)
_NAMES = frozenset({function.__name__ for function in FUNCTIONS} | {"sigmoid"})


def calls_activation_functions(module: nn.Module) -> bool:
    """Whether ``module``'s forward names an activation function (a cheap test before tracing it)."""
    code = getattr(type(module).forward, "__code__", None)
    return (
        code is not None and not _NAMES.isdisjoint(code.co_names) and not type(module).__module__.startswith("torch.")
    )


class _OneLevel(fx.Tracer):
    """Traces a module's own forward: its children are leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


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


def _line(node: fx.Node) -> str:
    """``model.py:830``: where the forward makes the call (the last frame outside torch)."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.stack_trace or "")
    outside = [(path, line) for path, line in frames if not path.startswith(_TORCH)]
    return f"{outside[-1][0].rpartition('/')[2]}:{outside[-1][1]}" if outside else "?"


def _operand(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_module" else node.name


def _rewrite_call(graph: fx.Graph, call: _Call, gated: bool, bits: int | None, erased: set[fx.Node]) -> str | None:
    """Replace ``call`` (fused with its product when ``gated``; alone when ``bits`` is set), adding the nodes it
    removes to ``erased``; what changed, or None."""
    product = _product_with(call) if gated and call.entry.gated else None
    where = f"{call.spelled}({_operand(call.input)})"
    if product is not None:
        node, up = product
        reader = next(iter(node.users)) if len(node.users) == 1 else None
        consumer = reader.target if reader is not None and reader.op == "call_module" else None
        with graph.inserting_before(node):
            layer = graph.get_attr(consumer) if consumer is not None else None
            fused = graph.call_function(gated_product, (call.input, up, call.entry.name, layer))
        saves = f"gate, and up unless {consumer} saves the product" if consumer is not None else "gate and up"
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        erased.add(node)
        described = f"{where} * {_operand(up)}: {call.entry.gated} fused, saves {saves}"
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
    return f"{described} ({_line(call.output)})"


def _in_features(layer: nn.Module) -> int | None:
    """The input width of a linear layer (plain, LoRA-wrapped, quantized) or a norm, if it says."""
    width = getattr(layer, "in_features", None)
    if isinstance(width, int):
        return width
    shape = getattr(layer, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and len(shape) == 1 and isinstance(shape[0], int):
        return shape[0]
    inner = next((getattr(layer, name) for name in ("linear", "base_layer") if hasattr(layer, name)), None)
    return _in_features(inner) if isinstance(inner, nn.Module) else None


def _check(module: nn.Module, graph: fx.Graph, function: object) -> None:
    """The rewritten forward computes what the stock one does (eval mode, a random input of the width of the
    first layer reading the input), or :class:`NotConvertible`."""
    first = next((n for n in graph.nodes if n.op == "placeholder"), None)
    reader = next((u for u in first.users if u.op == "call_module"), None) if first is not None else None
    width = _in_features(module.get_submodule(reader.target)) if reader is not None else None
    parameter = next((p for p in module.parameters() if p.is_floating_point()), None)
    if width is None or parameter is None:
        raise NotConvertible(
            "calls activations as functions, but no linear layer or norm reads its input to check it on"
        )
    x = torch.randn(2, 3, width, dtype=parameter.dtype, device=parameter.device)
    tolerance = 1e-4 if parameter.dtype in (torch.float32, torch.float64) else 1e-2
    try:
        with probe_mode(module, train=False), torch.autocast(x.device.type, enabled=False):
            expected, got = module(x), function(module, x)
        same = torch.allclose(got, expected, rtol=tolerance, atol=tolerance)
    except Exception as err:  # noqa: BLE001 - any failure means: the rewrite does not hold
        raise NotConvertible(f"its rewritten forward fails on a probe ({type(err).__name__})") from None
    if not same:
        raise NotConvertible("its rewritten forward computes something else than the stock one")


def rewrite(module: nn.Module, gated: bool, bits: int | None) -> RewrittenForward | None:
    """``module``'s forward with its activation calls replaced (gated products fused when ``gated``, other
    calls by their ``bits``-bit step op when ``bits`` is set), checked; ``None`` if it calls none; else
    :class:`NotConvertible`."""
    if "training" in type(module).forward.__code__.co_names:
        raise NotConvertible("calls activations as functions, but its forward reads self.training (tracing fixes it)")
    try:
        graph = _OneLevel().trace(module)
    except Exception as err:  # noqa: BLE001 - any failure means: its forward is not traceable
        raise NotConvertible(f"calls activations as functions, but its forward cannot be traced ({type(err).__name__})")
    sites, erased = [], set()
    for node in list(graph.nodes):
        call = _activation_call(node) if node not in erased else None
        site = _rewrite_call(graph, call, gated, bits, erased) if call is not None else None
        if site is not None:
            sites.append(site)
    if not sites:
        return None
    graph.lint()
    function = type(fx.GraphModule(module, graph)).forward
    _check(module, graph, function)
    return RewrittenForward(module, function, tuple(sites), any(" fused, " in site for site in sites))
