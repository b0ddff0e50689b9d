"""A linear layer whose input is a memory-sharing norm's affine-free output ``z``.

``linear(gamma * z + beta, W, b)`` saves ``z`` (the very tensor the norm saved) and parameters
only, and recomputes the affine in backward, so the norm's affine can move into its consumers
without renaming a parameter. Parameters are saved as they are and cast to the compute dtype
again in backward: under autocast no half-precision weight copy is kept either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _affine(z: torch.Tensor, gamma: torch.Tensor | None, beta: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``gamma * z + beta`` in the parameters' precision, returned in ``dtype``."""
    if gamma is None and beta is None:
        return z.to(dtype)
    param = gamma if gamma is not None else beta
    out = z.to(param.dtype)
    if gamma is not None:
        out = out * gamma
    if beta is not None:
        out = out + beta
    return out.to(dtype)


class AffineLinearFunction(torch.autograd.Function):
    """``linear(gamma * z + beta, W, b)`` in ``dtype``, saving ``z`` and parameters only.

    Without an affine the input is saved in the compute dtype, as a stock linear would.
    """

    @staticmethod
    def forward(ctx, z, weight, bias, gamma, beta, dtype: torch.dtype):
        with torch.autocast(z.device.type, enabled=False):
            x = _affine(z, gamma, beta, dtype)
            out = F.linear(x, weight.to(dtype), None if bias is None else bias.to(dtype))
        shared = z if gamma is not None or beta is not None else x
        _, needs_w, _, needs_gamma, _, _ = ctx.needs_input_grad
        # only the weight and gamma gradients read the input: a frozen linear saves none, as stock
        ctx.save_for_backward(shared if needs_w or needs_gamma else None, weight, gamma, beta)
        ctx.dtype, ctx.z_dtype = dtype, z.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        z, weight, gamma, beta = ctx.saved_tensors
        needs_z, needs_w, needs_b, needs_gamma, needs_beta, _ = ctx.needs_input_grad
        dtype = ctx.dtype
        grad = grad.to(dtype)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_z = grad_w = grad_b = grad_gamma = grad_beta = None
        if needs_w:
            x = _affine(z, gamma, beta, dtype)
            grad_w = (grad_2d.t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
        if needs_b:
            grad_b = grad_2d.sum(0).to(weight.dtype)
        if needs_z or needs_gamma or needs_beta:
            grad_x = grad @ weight.to(dtype)
            if needs_gamma:
                rows = grad_x.reshape(-1, *gamma.shape).to(gamma.dtype) * z.reshape(-1, *gamma.shape).to(gamma.dtype)
                grad_gamma = rows.sum(0)
            if needs_beta:
                grad_beta = grad_x.reshape(-1, *beta.shape).to(beta.dtype).sum(0)
            if needs_z:
                grad_z = grad_x if gamma is None else grad_x.to(gamma.dtype) * gamma
                grad_z = grad_z.to(ctx.z_dtype)
        return grad_z, grad_w, grad_b, grad_gamma, grad_beta, None


def affine_linear(
    z: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gamma: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.linear(gamma * z + beta, weight, bias)`` computed in ``dtype`` (default: the weight's),
    saving only ``z`` for backward."""
    return AffineLinearFunction.apply(z, weight, bias, gamma, beta, dtype or weight.dtype)
