"""Forwards traced one level deep by torch.fx (the module's children are leaves, called as they are), rewritten,
checked against the stock forward and compiled into a function the module runs on itself
(:class:`~lightning_lowmem.nn.rewritten.RewrittenForward`; the module keeps its class and children). The
families that find things by data flow use it: activations called as functions (:mod:`.families.functional`),
hand-written LoRA layers (:mod:`.families.lora`).

Tracing takes the module's attributes as they are, so a forward that reads ``self.training`` is left alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from lightning_lowmem.surgery.example import probe_mode
from lightning_lowmem.surgery.identify import NotConvertible, input_width

_TORCH = str(Path(torch.__file__).parent)


class _OneLevel(fx.Tracer):
    """Traces a module's own forward: its children are leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def trace(module: nn.Module, what: str) -> fx.Graph:
    """``module``'s forward as a graph, one level deep, or :class:`NotConvertible` (``what`` it does, for the
    reason)."""
    if "training" in type(module).forward.__code__.co_names:
        raise NotConvertible(f"{what}, but its forward reads self.training (tracing fixes it)")
    try:
        return _OneLevel().trace(module)
    except Exception as err:  # noqa: BLE001 - any failure means: its forward is not traceable
        raise NotConvertible(f"{what}, but its forward cannot be traced ({type(err).__name__})") from None


def call_site(node: fx.Node) -> str:
    """``model.py:830``: where the forward makes the call (the last frame outside torch)."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.stack_trace or "")
    outside = [(path, line) for path, line in frames if not path.startswith(_TORCH)]
    return f"{outside[-1][0].rpartition('/')[2]}:{outside[-1][1]}" if outside else "?"


def operand(node: fx.Node) -> str:
    """How the report names a value of the graph: the child called, or the node."""
    return str(node.target) if node.op == "call_module" else node.name


def _check(module: nn.Module, graph: fx.Graph, function: Callable[..., Any], width: int | None) -> None:
    """The rewritten forward computes what the stock one does (eval mode, a random input of ``width``, else the
    width of the first layer reading the input), or :class:`NotConvertible`."""
    if width is None:
        first = next((n for n in graph.nodes if n.op == "placeholder"), None)
        reader = next((u for u in first.users if u.op == "call_module"), None) if first is not None else None
        width = input_width(module.get_submodule(reader.target)) if reader is not None else None
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


def compiled(module: nn.Module, graph: fx.Graph, width: int | None = None) -> Callable[..., Any]:
    """The rewritten ``graph`` as a function of the module and its inputs, checked against the module's stock
    forward on inputs of ``width`` features (default: the first layer reading them says), or
    :class:`NotConvertible`."""
    graph.lint()
    function = type(fx.GraphModule(module, graph)).forward
    _check(module, graph, function, width)
    return function
