"""Linear layers that read a memory-sharing norm's output and save only the norm's ``z``.

A memory-sharing norm (:mod:`.norm`) saves its affine-free output ``z`` and returns the stock output
``y = (gamma + offset) * z + beta``, so every reader sees the stock values. A linear layer that reads
``y`` can then save ``z`` in place of its input (:func:`affine_linear`): the norm and all its consumer
linears keep one tensor instead of two. The input gradient goes to ``y`` as stock's does (the norm's
backward handles the affine once for all readers); only the weight gradient needs ``y``, and takes it
from ``z``. Parameters are saved as they are and cast to the compute dtype again in backward: under
autocast no half-precision weight copy is kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_lowmem import kernels
from lightning_lowmem.kernels import library, torch_ops
from lightning_lowmem.ops.dropout import draw_seed, dropping
from lightning_lowmem.ops.norm import affine_values


def _weight_grad(
    grad_2d: torch.Tensor,
    grad_sum: torch.Tensor | None,
    saved: torch.Tensor,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    dtype: torch.dtype,
    offset: float,
    shared: bool,
    weight_dtype: torch.dtype,
) -> torch.Tensor:
    """``grad^T @ x`` in ``weight_dtype``. From a shared ``z`` (``x = (gamma + offset) * z + beta`` over the input
    features) it is ``(grad^T @ z) * (gamma + offset) + outer(sum(grad), beta)`` (the kernels' ``affine_weight_grad``,
    one pass): ``x`` is never rebuilt, so nothing but ``z`` crosses from forward to backward, also under
    torch.compile (whose partitioner saves a rebuilt ``x`` rather than recompute it) and the extra work is
    weight-sized, not activation-sized. ``grad_sum`` is ``sum(grad)`` when the bias gradient has already computed
    it."""
    grad_w = grad_2d.t() @ saved.reshape(-1, saved.shape[-1]).to(dtype)
    if not shared or (gamma is None and beta is None):
        return grad_w.to(weight_dtype)
    scale, shift = affine_values(weight_dtype, gamma, beta, offset)
    if beta is not None and grad_sum is None:
        grad_sum = grad_2d.sum(0)
    total = None if beta is None else grad_sum
    return kernels.implementation(grad_w.device).affine_weight_grad(grad_w, total, scale, shift, weight_dtype)


class AffineLinearFunction(torch.autograd.Function):
    """``F.linear(x, W, b)`` in ``dtype`` saving, instead of ``x``, the ``z`` with ``x = (gamma + offset) * z + beta``
    (or ``x``, as it is when ``dtype`` holds it exactly, else in ``dtype``, when ``z`` is ``None``), and
    parameters only. ``z``, ``gamma`` and ``beta`` get no gradient here: ``x`` gets it, as from a stock linear.
    With a ``seed``, the layer's input is a dropout of ``x`` drawn from it: applied here (``applies``: a LoRA
    adapter's dropout, folded in), or already (``x`` a seeded dropout of the norm's output, ``z`` the norm's);
    either way it saves what it saves without a dropout, plus the seed, and regenerates the dropped input for
    its weight gradient.
    ``lowmem::affine_linear`` is this function in C++ (the eager path of the compiled backends), which draws its
    seed from the device's generator itself."""

    @staticmethod
    def forward(ctx, x, z, weight, bias, gamma, beta, dtype: torch.dtype, offset: float, p: float, seed, applies: bool):
        x_in = x.to(dtype)  # under autocast ``dtype`` is its dtype: autocast has nothing left to cast
        read = kernels.implementation(x.device).dropout(x_in, p, seed) if applies else x_in
        out = F.linear(read, weight.to(dtype), None if bias is None else bias.to(dtype))
        # only the weight gradient reads the input: a frozen linear saves none, as stock; a narrower
        # input (bf16 into fp32 adapters) is saved as it is, and widened again in backward
        narrower = torch.promote_types(x.dtype, dtype) == dtype
        saved = (z if z is not None else x if narrower else x_in) if ctx.needs_input_grad[2] else None
        ctx.save_for_backward(saved, weight, gamma, beta, seed)
        ctx.dtype, ctx.x_dtype, ctx.shared, ctx.offset, ctx.p, ctx.applies = (
            dtype,
            x.dtype,
            z is not None,
            offset,
            p,
            applies,
        )
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved, weight, gamma, beta, seed = ctx.saved_tensors
        needs_x, _, needs_w, needs_b = ctx.needs_input_grad[:4]
        dtype = ctx.dtype
        grad = grad.to(dtype)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        grad_sum = grad_2d.sum(0) if needs_b else None  # one pass over grad, for the bias and the beta term
        impl = kernels.implementation(grad.device)
        if needs_x:
            grad_x = grad @ weight.to(dtype)
        if needs_w and ctx.applies and needs_x:  # the input the layer read and the gradient of it: one mask, one pass
            scale, shift = _affine(ctx, gamma, beta)
            read, grad_x = impl.dropout_input_and_grad(saved, scale, shift, dtype, grad_x, ctx.p, seed)
            grad_w = grad_2d.t() @ read.reshape(-1, read.shape[-1])
        elif needs_w and seed is not None:
            grad_w = grad_2d.t() @ _dropped_input(ctx, saved, gamma, beta, seed)
        elif needs_w:
            grad_w = _weight_grad(grad_2d, grad_sum, saved, gamma, beta, dtype, ctx.offset, ctx.shared, weight.dtype)
        elif needs_x and ctx.applies:  # the mask, applied to the gradient of what the layer read
            grad_x = impl.dropout(grad_x, ctx.p, seed)
        if needs_w:
            grad_w = grad_w.to(weight.dtype)
        if needs_b:
            grad_b = grad_sum.to(weight.dtype)
        if needs_x:
            grad_x = grad_x.to(ctx.x_dtype)
        return grad_x, None, grad_w, grad_b, None, None, None, None, None, None, None


def _norm_output(ctx, z: torch.Tensor, gamma, beta) -> torch.Tensor:
    """The output ``y`` of the norm whose ``z`` the layer shares, rebuilt as the norm computed it: its affine in
    the accumulate dtype, rounded once to ``z``'s dtype (``y``'s)."""
    return torch_ops.affine(z, *affine_values(z.dtype, gamma, beta, ctx.offset))


def _affine(ctx, gamma, beta) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The affine that rebuilds the input from a shared ``z`` (scale, shift: ``dropout_input_and_grad``'s arguments,
    in the compute dtype's accumulate dtype; the kernels round the result to ``z``'s dtype as the norm rounded its
    output, then to the compute dtype), or none."""
    return affine_values(ctx.dtype, gamma, beta, ctx.offset) if ctx.shared else (None, None)


def _dropped_input(ctx, saved: torch.Tensor, gamma, beta, seed: torch.Tensor) -> torch.Tensor:
    """The input the layer read in forward, as rows: its input ``x`` rebuilt (from a shared ``z``: the norm's output)
    and the mask of its seed taken where the forward took it: the layer's own in the layer's dtype, a dropout
    before it (a seeded dropout of the norm's output) in ``x``'s."""
    shares_affine = ctx.shared and (gamma is not None or beta is not None)
    x = _norm_output(ctx, saved, gamma, beta) if shares_affine else saved
    dropout = kernels.implementation(saved.device).dropout
    dropped = dropout(x.to(ctx.dtype), ctx.p, seed) if ctx.applies else dropout(x, ctx.p, seed).to(ctx.dtype)
    return dropped.reshape(-1, dropped.shape[-1])


def affine_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    z: torch.Tensor | None = None,
    gamma: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    offset: float = 0.0,
    dropout: float = 0.0,
    dropped: tuple[float, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed in ``dtype`` (default: the weight's) that saves ``z`` for
    backward where ``x = (gamma + offset) * z + beta`` (a memory-sharing norm's output), else ``x`` in ``dtype``.
    With ``dropout`` (a probability in (0, 1)) it computes ``F.linear(F.dropout(x, dropout), ...)`` saving the
    same, plus a seed (:mod:`.dropout`); ``dropped``: ``(p, seed)`` of the seeded dropout that made ``x`` from
    the norm's output, to save ``z`` and the seed for ``x``."""
    args = (x, z, weight, bias, gamma, beta, dtype or weight.dtype, float(offset))
    dropout = dropout if dropping(True) else 0.0
    if kernels.autograd_in_cpp(x):  # the C++ function draws a dropout's seed itself, as ATen's dropout does
        return library.OPS.affine_linear.default(*args, *(dropped or (float(dropout), None)))
    if dropout:
        return AffineLinearFunction.apply(*args, dropout, draw_seed(x.device), True)
    if dropped is not None:
        return AffineLinearFunction.apply(*args, *dropped, False)
    return AffineLinearFunction.apply(*args, 0.0, None, False)
