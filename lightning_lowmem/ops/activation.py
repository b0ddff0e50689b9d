"""ReGELU2 / ReSiLU2: exact GELU / SiLU forward, 2-bit step-derivative backward.

Only a uint8 buffer of ``ceil(numel / 4)`` bytes is saved for backward, instead of the
whole input (16 or 32 bits per element).
"""

from __future__ import annotations

import torch

from lightning_lowmem import kernels
from lightning_lowmem.ops._checks import check_float_tensor, needs_graph, refuse_double_backward
from lightning_lowmem.ops.constants import GELU_2BIT, SILU_2BIT, StepDerivative

_GELU_KINDS = {"none": "gelu", "tanh": "gelu_tanh"}


class StepDerivativeActivation(torch.autograd.Function):
    """Stock activation forward; backward multiplies by a step derivative of 2-bit codes."""

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


def regelu2(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU forward (erf, or tanh with ``approximate="tanh"``) with a 2-bit backward."""
    if approximate not in _GELU_KINDS:
        raise ValueError(f"regelu2: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _apply("regelu2", x, _GELU_KINDS[approximate], GELU_2BIT)


def resilu2(x: torch.Tensor) -> torch.Tensor:
    """SiLU forward with a 2-bit backward."""
    return _apply("resilu2", x, "silu", SILU_2BIT)
