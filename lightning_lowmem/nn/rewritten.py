"""A module whose forward calls activations as functions, with that forward rewritten to call the low-memory ops.

The module keeps its class, children, parameters and state_dict; only its ``forward`` is shadowed on the
instance by :class:`RewrittenForward`, which runs the rewritten code (see
:mod:`lightning_lowmem.surgery.tracing`) on the module itself, so that its children are looked up at each
call (a child the surgery replaces too is the new one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class RewrittenForward:
    """``function(module, *args)``: ``module``'s forward, rewritten; ``sites`` describes each change for the
    report, ``fused`` says whether one is a gated product."""

    def __init__(self, module: nn.Module, function: Callable[..., Any], sites: tuple[str, ...], fused: bool) -> None:
        self.module, self.function, self.sites, self.fused = module, function, sites, fused

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(self.module, *args, **kwargs)


def rewritten_forward_of(module: nn.Module) -> RewrittenForward | None:
    """The :class:`RewrittenForward` installed on ``module``, if any."""
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, RewrittenForward) else None
