"""Activations with an exact forward and a k-bit step-derivative backward (ReGELU2, ReSiLU2, ...).

Only a uint8 buffer of ``ceil(numel * k / 8)`` bytes is saved for backward (``k`` = 1, 2 or 4
bits per element; 3-bit codes are stored in 4), instead of the whole input (16 or 32 bits per
element). ``bits=2`` (the default) is the paper's method and constants. Any activation of
:mod:`lightning_lowmem.registry.activations` works: GELU (erf, tanh), SiLU, QuickGELU, Mish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from lightning_lowmem import kernels
from lightning_lowmem.kernels import library
from lightning_lowmem.ops._checks import check_float_tensor, needs_graph, refuse_double_backward
from lightning_lowmem.registry.activations import StepDerivative, get_activation

_GELU_KINDS = {"none": "gelu", "tanh": "gelu_tanh"}
_exact = 0


@contextmanager
def exact_derivatives() -> Iterator[None]:
    """Every activation of this module with the stock function's exact derivative for the duration, its forward still
    this module's: the verify stage checks a training step against the stock model's to rounding, the k-bit
    approximation aside (its own error is measured apart)."""
    global _exact
    _exact += 1
    try:
        yield
    finally:
        _exact -= 1


class StepActivationFunction(torch.autograd.Function):
    """Stock activation forward; backward multiplies by a step derivative of k-bit codes. ``kind``: the kernels'
    id of the activation (for a contiguous input they then compute output and codes in one call, in one pass
    where they can), or None for ``stock`` and a separate codes pass. ``lowmem::step_activation`` is this
    function in C++ for a contiguous input of a kernels' kind (the eager path of the compiled backends)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stock: Callable, kind: str | None, step: StepDerivative, name: str):
        impl = kernels.implementation(x.device)
        if kind is None or not x.is_contiguous():  # a strided input: the stock op's own layout and element order
            y, packed = stock(x), impl.act_codes(x, step.thresholds)
        else:
            y, packed = impl.act_forward(x, kind, step.thresholds)
        ctx.save_for_backward(packed)
        ctx.levels = step.levels
        ctx.op = name  # not ctx.name: that would hide the node's name()
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_double_backward(ctx.op)
        (packed,) = ctx.saved_tensors
        grad_input = kernels.implementation(grad.device).act_backward(grad, packed, ctx.levels)
        return grad_input, None, None, None, None


def _apply(op: str, x: torch.Tensor, activation: str, bits: int) -> torch.Tensor:
    entry = get_activation(activation, op)
    step = entry.step_derivative(bits, op)
    check_float_tensor(op, x)
    if not needs_graph(x):
        return entry.stock(x)
    if entry.kernel is not None and x.is_contiguous() and kernels.autograd_in_cpp(x):
        y = library.OPS.step_activation.default(x, entry.kernel, step.thresholds, step.levels, op)
    else:
        y = StepActivationFunction.apply(x, entry.stock, entry.kernel, step, op)
    if _exact:
        exact = entry.stock(x)
        return exact + (y - exact).detach()  # this forward's values, the exact derivative
    return y


def step_activation(x: torch.Tensor, activation: str = "gelu", bits: int = 2) -> torch.Tensor:
    """``activation`` (a name of the registry) forward, exact, with a ``bits``-bit backward (1-4)."""
    return _apply("step_activation", x, activation, bits)


def regelu2(x: torch.Tensor, approximate: str = "none", bits: int = 2) -> torch.Tensor:
    """GELU forward (erf, or tanh with ``approximate="tanh"``) with a ``bits``-bit backward (1-4)."""
    if approximate not in _GELU_KINDS:
        raise ValueError(f"regelu2: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _apply("regelu2", x, _GELU_KINDS[approximate], bits)


def resilu2(x: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """SiLU forward with a ``bits``-bit backward (1-4)."""
    return _apply("resilu2", x, "silu", bits)
