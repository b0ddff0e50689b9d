"""The affine of a memory-sharing norm, and the linear layers that read its output, saving only ``z``.

A memory-sharing norm saves its affine-free output ``z``. It still returns the stock output
``y = gamma * z + beta`` (:func:`norm_affine`, which saves nothing new: ``z`` is already saved),
so every reader sees the stock values. A linear layer that reads ``y`` can then save ``z`` in
place of its input (:func:`affine_linear`) and recompute ``y`` in backward: the norm and all
its consumer linears keep one tensor instead of two. Parameters are saved as they are and cast
to the compute dtype again in backward: under autocast no half-precision weight copy is kept.
``offset`` is added to ``gamma`` inside the ops (Gemma's RMSNorm scales by ``1 + weight``), so that
nothing but the parameter itself is saved.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _affine(
    z: torch.Tensor, gamma: torch.Tensor | None, beta: torch.Tensor | None, dtype: torch.dtype, offset: float = 0.0
) -> torch.Tensor:
    """``(gamma + offset) * z + beta`` in the parameters' precision, returned in ``dtype``."""
    if gamma is None and beta is None:
        return z.to(dtype)
    param = gamma if gamma is not None else beta
    out = z.to(param.dtype)
    scale = None if gamma is None else gamma + offset if offset else gamma
    if scale is not None and beta is not None:
        out = torch.addcmul(beta, out, scale)  # one pass
    elif scale is not None:
        out = out * scale
    else:
        out = out + beta
    return out.to(dtype)


def _rows(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` as rows of ``like``'s shape, in ``like``'s dtype."""
    return t.reshape(-1, *like.shape).to(like.dtype)


def _affine_grads(
    grad_y: torch.Tensor,
    z: torch.Tensor | None,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    offset: float,
    needs: tuple,
    owned: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``y = (gamma + offset) * z + beta`` for ``z``, ``gamma``, ``beta`` (where ``needs`` says so).
    ``owned``: ``grad_y`` is a temporary of the caller's, multiplied by ``z`` in place for ``gamma``'s gradient
    (last), saving an activation-sized allocation."""
    needs_z, needs_gamma, needs_beta = needs
    grad_z = grad_gamma = grad_beta = None
    if needs_beta:
        grad_beta = _rows(grad_y, beta).sum(0)
    if needs_z:
        grad_z = grad_y if gamma is None else grad_y.to(gamma.dtype) * (gamma + offset if offset else gamma)
    if needs_gamma:
        rows, z_rows = _rows(grad_y, gamma), _rows(z, gamma)  # both in gamma's dtype
        grad_gamma = (rows.mul_(z_rows) if owned else rows * z_rows).sum(0)
    return grad_z, grad_gamma, grad_beta


class NormAffineFunction(torch.autograd.Function):
    """``y = (gamma + offset) * z + beta`` in ``dtype``, saving ``z`` (the norm's own saved tensor) only for
    ``gamma``."""

    @staticmethod
    def forward(ctx, z, gamma, beta, dtype: torch.dtype, offset: float):
        with torch.autocast(z.device.type, enabled=False):
            y = _affine(z, gamma, beta, dtype, offset)
        ctx.save_for_backward(z if ctx.needs_input_grad[1] else None, gamma, beta)
        ctx.z_dtype, ctx.offset = z.dtype, offset
        # when every reader of y is a linear layer taking z instead, y gets no gradient: autograd still
        # calls backward, with None rather than a tensor of zeros to multiply and sum
        ctx.set_materialize_grads(False)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None, None, None, None, None
        z, gamma, beta = ctx.saved_tensors
        grad_z, grad_gamma, grad_beta = _affine_grads(grad, z, gamma, beta, ctx.offset, ctx.needs_input_grad[:3])
        return None if grad_z is None else grad_z.to(ctx.z_dtype), grad_gamma, grad_beta, None, None


def norm_affine(
    z: torch.Tensor, gamma: torch.Tensor | None, beta: torch.Tensor | None, dtype: torch.dtype, offset: float = 0.0
) -> torch.Tensor:
    """The stock norm output ``(gamma + offset) * z + beta`` in ``dtype``; ``z`` itself when there is nothing to do."""
    if gamma is None and beta is None and z.dtype == dtype:
        return z
    return NormAffineFunction.apply(z, gamma, beta, dtype, offset)


def _weight_grad(
    grad_2d: torch.Tensor,
    grad_sum: torch.Tensor | None,
    saved: torch.Tensor,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    dtype: torch.dtype,
    offset: float,
    shared: bool,
) -> torch.Tensor:
    """``grad^T @ x``. From a shared ``z`` (``x = (gamma + offset) * z + beta`` over the input features) it
    is ``(grad^T @ z) * (gamma + offset) + outer(sum(grad), beta)``: ``x`` is never rebuilt, so nothing but
    ``z`` crosses from forward to backward, also under torch.compile (whose partitioner saves a rebuilt
    ``x`` rather than recompute it) and the extra work is weight-sized, not activation-sized. ``grad_sum``
    is ``sum(grad)`` when the bias gradient has already computed it."""
    inputs = saved.reshape(-1, saved.shape[-1]).to(dtype)
    grad_w = grad_2d.t() @ inputs
    if shared and gamma is not None:
        grad_w = grad_w * (gamma + offset if offset else gamma)
    if shared and beta is not None:
        grad_w = grad_w + (grad_2d.sum(0) if grad_sum is None else grad_sum).unsqueeze(1) * beta
    return grad_w


class AffineLinearFunction(torch.autograd.Function):
    """``F.linear(x, W, b)`` in ``dtype`` saving, instead of ``x``, the ``z`` with ``x = (gamma + offset) * z + beta``
    (or ``x``, as it is when ``dtype`` holds it exactly, else in ``dtype``, when ``z`` is ``None``), and
    parameters only."""

    @staticmethod
    def forward(ctx, x, z, weight, bias, gamma, beta, dtype: torch.dtype, offset: float):
        with torch.autocast(x.device.type, enabled=False):
            x_in = x.to(dtype)
            out = F.linear(x_in, weight.to(dtype), None if bias is None else bias.to(dtype))
        _, _, needs_w, _, needs_gamma, _, _, _ = ctx.needs_input_grad
        # only the weight and gamma gradients read the input: a frozen linear saves none, as stock; a
        # narrower input (bf16 into fp32 adapters) is saved as it is, and widened again in backward
        narrower = torch.promote_types(x.dtype, dtype) == dtype
        saved = (z if z is not None else x if narrower else x_in) if needs_w or needs_gamma else None
        ctx.save_for_backward(saved, weight, gamma, beta)
        ctx.dtype, ctx.x_dtype, ctx.shared, ctx.offset = dtype, x.dtype, z is not None, offset
        ctx.z_dtype = None if z is None else z.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved, weight, gamma, beta = ctx.saved_tensors
        needs_x, needs_z, needs_w, needs_b, needs_gamma, needs_beta, _, _ = ctx.needs_input_grad
        dtype = ctx.dtype
        grad = grad.to(dtype)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_z = grad_w = grad_b = grad_gamma = grad_beta = None
        grad_sum = grad_2d.sum(0) if needs_b else None  # one pass over grad, for the bias and the beta term
        if needs_w:
            grad_w = _weight_grad(grad_2d, grad_sum, saved, gamma, beta, dtype, ctx.offset, ctx.shared)
            grad_w = grad_w.to(weight.dtype)
        if needs_b:
            grad_b = grad_sum.to(weight.dtype)
        if needs_x or needs_z or needs_gamma or needs_beta:
            grad_in = grad @ weight.to(dtype)
            if not ctx.shared:
                grad_x = grad_in.to(ctx.x_dtype)
            else:
                needs = (needs_z, needs_gamma, needs_beta)
                grad_z, grad_gamma, grad_beta = _affine_grads(
                    grad_in, saved, gamma, beta, ctx.offset, needs, owned=True
                )
                grad_z = None if grad_z is None else grad_z.to(ctx.z_dtype)
        return grad_x, grad_z, grad_w, grad_b, grad_gamma, grad_beta, None, None


def affine_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    z: torch.Tensor | None = None,
    gamma: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    offset: float = 0.0,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed in ``dtype`` (default: the weight's) that saves ``z`` for
    backward where ``x = (gamma + offset) * z + beta`` (a memory-sharing norm's output), else ``x`` in ``dtype``."""
    return AffineLinearFunction.apply(x, z, weight, bias, gamma, beta, dtype or weight.dtype, offset)
