"""Memory-sharing LayerNorm / RMSNorm (paper, section 5 and appendix H).

The norm saves its own affine-free output ``z`` and one rstd per row. ``z`` is the very
tensor a following linear layer saves as its input, so the pair costs one activation
instead of two. Under autocast the output is returned in the autocast dtype, otherwise
the linear would save its own cast copy and nothing would be shared.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_lowmem import kernels
from lightning_lowmem.ops._checks import check_float_tensor, needs_graph, refuse_double_backward
from lightning_lowmem.ops.autocast import autocast_dtype

_AUTOCAST_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


class MemorySharingNorm(torch.autograd.Function):
    """Affine-free norm whose backward needs only its output and rstd."""

    @staticmethod
    def forward(ctx, x, dim: int, eps: float, center: bool, out_dtype: torch.dtype, name: str):
        z, rstd = kernels.implementation(x.device).norm_forward(x, dim, eps, center, out_dtype)
        ctx.save_for_backward(z, rstd)
        ctx.dim, ctx.center, ctx.in_dtype, ctx.name = dim, center, x.dtype, name
        return z

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_double_backward(ctx.name)
        z, rstd = ctx.saved_tensors
        grad_input = kernels.implementation(grad.device).norm_backward(grad, z, rstd, ctx.dim, ctx.center, ctx.in_dtype)
        return grad_input, None, None, None, None, None


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The input dtype, or the autocast dtype when autocast is on for ``x``'s device."""
    compute = autocast_dtype(x.device.type) if x.dtype in _AUTOCAST_INPUTS else None
    return compute or x.dtype


def _normalized_size(name: str, x: torch.Tensor, normalized_shape: int | Sequence[int]) -> int:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or tuple(x.shape[-len(shape) :]) != shape or x.dim() < len(shape):
        raise ValueError(
            f"{name}: normalized_shape {list(shape)} must match the trailing dimensions of the input, "
            f"got input of shape {list(x.shape)}"
        )
    return math.prod(shape)


def _apply(name: str, x: torch.Tensor, normalized_shape, eps: float, center: bool) -> torch.Tensor:
    check_float_tensor(name, x)
    dim = _normalized_size(name, x, normalized_shape)
    if not eps > 0:
        raise ValueError(f"{name}: eps must be positive, got {eps}")
    out_dtype = output_dtype(x)
    if x.numel() == 0:  # nothing to normalize (no rows, or rows of 0 elements): as stock, an empty output
        return x.to(dtype=out_dtype, copy=True)
    x = x.contiguous()
    if not needs_graph(x):
        z, _ = kernels.implementation(x.device).norm_forward(x, dim, eps, center, out_dtype)
        return z
    return MemorySharingNorm.apply(x, dim, float(eps), center, out_dtype, name)


def ms_layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], eps: float = 1e-5) -> torch.Tensor:
    """Affine-free LayerNorm that saves only its output and an fp32 rstd per row."""
    return _apply("ms_layer_norm", x, normalized_shape, eps, center=True)


def ms_rms_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], eps: float = 1e-6) -> torch.Tensor:
    """Affine-free RMSNorm that saves only its output and an fp32 rstd per row."""
    return _apply("ms_rms_norm", x, normalized_shape, eps, center=False)
