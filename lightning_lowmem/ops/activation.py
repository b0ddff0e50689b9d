"""ReGELU2 / ReSiLU2: exact GELU / SiLU forward, k-bit step-derivative backward.

Only a uint8 buffer of ``ceil(numel * k / 8)`` bytes is saved for backward (``k`` = 1, 2 or 4
bits per element; 3-bit codes are stored in 4), instead of the whole input (16 or 32 bits per
element). ``bits=2`` (the default) is the paper's method and constants.
"""

from __future__ import annotations

import torch

from lightning_lowmem import kernels
from lightning_lowmem.ops._checks import check_float_tensor, needs_graph, refuse_double_backward
from lightning_lowmem.ops.constants import StepDerivative, step_derivative

_GELU_KINDS = {"none": "gelu", "tanh": "gelu_tanh"}


class StepDerivativeActivation(torch.autograd.Function):
    """Stock activation forward; backward multiplies by a step derivative of k-bit codes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kind: str, step: StepDerivative, name: str) -> torch.Tensor:
        y, packed = kernels.implementation(x.device).act_forward(x, kind, step.thresholds)
        ctx.save_for_backward(packed)
        ctx.levels = step.levels
        ctx.name = name
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_double_backward(ctx.name)
        (packed,) = ctx.saved_tensors
        grad_input = kernels.implementation(grad.device).act_backward(grad, packed, ctx.levels)
        return grad_input, None, None, None


def _apply(name: str, x: torch.Tensor, kind: str, step: StepDerivative) -> torch.Tensor:
    check_float_tensor(name, x)
    if not needs_graph(x):
        return kernels.torch_ops.stock_activation(x, kind)
    return StepDerivativeActivation.apply(x, kind, step, name)


def regelu2(x: torch.Tensor, approximate: str = "none", bits: int = 2) -> torch.Tensor:
    """GELU forward (erf, or tanh with ``approximate="tanh"``) with a ``bits``-bit backward (1-4)."""
    if approximate not in _GELU_KINDS:
        raise ValueError(f"regelu2: approximate must be 'none' or 'tanh', got {approximate!r}")
    kind = _GELU_KINDS[approximate]
    return _apply("regelu2", x, kind, _step("regelu2", kind, bits))


def resilu2(x: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """SiLU forward with a ``bits``-bit backward (1-4)."""
    return _apply("resilu2", x, "silu", _step("resilu2", "silu", bits))


def _step(name: str, kind: str, bits: int) -> StepDerivative:
    try:
        return step_derivative(kind, bits)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
