"""Memory-sharing LayerNorm / RMSNorm (paper, section 5 and appendix H).

The norm saves its own affine-free output ``z`` and one rstd per row, and returns the stock output
``y = (gamma + offset) * z + beta``. ``z`` is the very tensor a following linear layer saves in place
of ``y`` (:func:`~lightning_lowmem.ops.affine_linear`), so the pair costs one activation instead of
two. Its backward takes ``dL/dy`` from every reader and computes the input, ``gamma`` and ``beta``
gradients in one kernel pass, as stock LayerNorm's does. ``offset`` is added to ``gamma`` inside the
op (Gemma's RMSNorm scales by ``1 + weight``), so that nothing but the parameter itself is saved.
Under autocast the output is returned in the autocast dtype, otherwise the linear would save its
own cast copy and nothing would be shared.

A frozen affine (LoRA leaves the norms frozen) needs no ``z`` for its own gradients, and on CPU the
norm then saves ``y`` itself (:func:`max_exact_columns`): the tensor its readers save as they are, so the
pair still costs one activation, and the forward writes one tensor, as stock's does, not two (on a
bandwidth-bound CPU the second write cost 25-40% of the fwd+bwd time). The backward rebuilds
``z = (y - beta) / gamma`` as it reads ``y``; the few columns where that loses precision (``gamma`` 0,
or ``|beta| > |gamma|``: 0.3% of pretrained MiniLM's) are saved exactly; where they are many, the norm
saves ``z``. Their number depends on the values, so under torch.compile the norm saves ``z``. A forward
that saves nothing (eval, ``torch.no_grad``) writes ``y`` alone on CPU too: writing ``z`` as well made it
1.7-1.9x stock's at LLaMA shapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_lowmem import kernels
from lightning_lowmem.kernels import library, torch_ops
from lightning_lowmem.kernels.torch_ops import accumulate_dtype, affine_grad_sums
from lightning_lowmem.ops._checks import check_float_tensor, refuse_double_backward
from lightning_lowmem.ops.autocast import autocast_dtype

_AUTOCAST_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def affine_scale(gamma: torch.Tensor, offset: float) -> torch.Tensor:
    """``gamma + offset``, the norm's scale (Gemma's RMSNorm: ``1 + weight``), added in fp32 at least, as Hugging
    Face's Gemma adds it (``1 + weight.float()``: in bfloat16 a weight near 0 lost all but 8 bits of itself, and
    a third of a bfloat16 norm's outputs differed from the stock model's); ``gamma`` itself without an offset."""
    return gamma.to(torch.promote_types(gamma.dtype, torch.float32)) + offset if offset else gamma


def affine_values(
    x_dtype: torch.dtype, gamma: torch.Tensor | None, beta: torch.Tensor | None, offset: float
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(gamma + offset, beta)`` as ``norm_affine_forward`` takes them: in the accumulate dtype of the input."""
    acc = accumulate_dtype(x_dtype)
    return (None if gamma is None else affine_scale(gamma, offset).to(acc)), (None if beta is None else beta.to(acc))


def output_affine(
    x_dtype: torch.dtype, gamma: torch.Tensor | None, beta: torch.Tensor | None, offset: float
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(gamma + offset, beta)`` as the output ops (``norm_output_forward`` / ``_backward``) take them: as they are
    where both are in the input's dtype or both in its accumulate dtype (the kernels widen them: a cast of a frozen
    bfloat16 affine before each call cost two operators a call, 3-4% of the norm's forward), else cast to the
    accumulate dtype."""
    acc = accumulate_dtype(x_dtype)
    scale = None if gamma is None else affine_scale(gamma, offset)
    dtypes = {t.dtype for t in (scale, beta) if t is not None}
    if len(dtypes) == 1 and dtypes <= {x_dtype, acc}:
        return scale, beta
    return tuple(None if t is None else t.to(acc) for t in (scale, beta))


def writes_output_alone(x: torch.Tensor) -> bool:
    """Whether ``x``'s kernels write ``y`` alone with the affine fused (``norm_output_forward``): the CPU ones.
    The GPU ones write ``z`` and ``y`` (their ``norm_output_forward`` is the PyTorch reference, and the count of
    exact columns would be read on the host: a synchronisation)."""
    return kernels.takes_host_side(x)


_NO_COLUMNS = torch.empty(0, dtype=torch.long, device="cpu")


MAX_EXACT_FRACTION = 1 / 32
"""A frozen norm saves ``y`` while at most this fraction of its columns need ``z`` saved exactly (it then saves
at most 3% more than ``z`` alone would cost); with more, it saves ``z``."""


def max_exact_columns(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, dim: int) -> int:
    """How many columns the norm may save ``z`` exactly at where it saves its output ``y`` rather than ``z``
    (:data:`MAX_EXACT_FRACTION` of them), or -1 where it saves ``z``: anything but an affine that needs no
    gradient on an input that does, in an eager CPU call. The norm finds the columns from the affine's values
    (``norm_exact_columns``), and saves ``z`` where there are more. See the module docstring."""
    if (weight is None and bias is None) or not x.requires_grad:
        return -1
    if (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad):
        return -1
    if not writes_output_alone(x) or torch.compiler.is_compiling():
        return -1
    return int(dim * MAX_EXACT_FRACTION)


class MemorySharingNormFunction(torch.autograd.Function):
    """Norm and affine that save only the affine-free output ``z`` and rstd. Returns ``(y, z)``, ``z``
    without a gradient of its own (readers that save it take ``dL/dy``), or ``z`` alone with no affine;
    ``(y, None)`` where it saves ``y``, and ``z`` at its exact columns, instead (at most ``max_exact`` of them,
    :func:`max_exact_columns`: readers save ``y`` as it is). ``lowmem::ms_norm`` is this function in C++ (the
    eager path of the compiled backends)."""

    @staticmethod
    def forward(
        ctx,
        x,
        gamma,
        beta,
        max_exact: int,
        dim: int,
        eps: float,
        center: bool,
        out_dtype: torch.dtype,
        offset: float,
        name: str,
    ):
        impl = kernels.implementation(x.device)
        affine = gamma is not None or beta is not None
        ctx.dim, ctx.center, ctx.in_dtype, ctx.offset, ctx.op = dim, center, x.dtype, offset, name
        ctx.saves_output = False
        if max_exact >= 0:
            scale, shift = output_affine(x.dtype, gamma, beta, offset)
            columns = impl.norm_exact_columns(scale, shift)
            ctx.saves_output = columns.numel() <= max_exact
            if ctx.saves_output:
                y, rstd, exact = impl.norm_output_forward(x, dim, eps, center, out_dtype, scale, shift, columns)
                ctx.save_for_backward(y, rstd, gamma, beta, columns, exact)
                return y, None
        if affine:
            scale, shift = affine_values(x.dtype, gamma, beta, offset)
            y, z, rstd = impl.norm_affine_forward(x, dim, eps, center, out_dtype, scale, shift)
        else:
            z, rstd = impl.norm_forward(x, dim, eps, center, out_dtype)
        # an input that needs no gradient (the first norm on frozen embeddings) keeps no rstd: the affine's
        # gradients need z only
        ctx.save_for_backward(z, rstd if ctx.needs_input_grad[0] else None, gamma, beta)
        if not affine:
            return z
        ctx.mark_non_differentiable(z)
        ctx.set_materialize_grads(False)  # z never gets a gradient: no zeros to make for it
        return y, z

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None, _=None):
        if grad is None:  # nothing read y (e.g. only the rows' z went on)
            return (None,) * 10
        refuse_double_backward(ctx.op)
        if ctx.saves_output:
            y, rstd, gamma, beta, columns, exact = ctx.saved_tensors
            scale, shift = output_affine(ctx.in_dtype, gamma, beta, ctx.offset)
            grad_input = kernels.implementation(grad.device).norm_output_backward(
                grad, y, rstd, scale, shift, columns, exact, ctx.dim, ctx.center, ctx.in_dtype
            )
            return grad_input, None, None, None, None, None, None, None, None, None
        z, rstd, gamma, beta = ctx.saved_tensors
        needs_input, needs_gamma, needs_beta = ctx.needs_input_grad[:3]
        acc = accumulate_dtype(z.dtype)
        if needs_input:
            scale = None if gamma is None else affine_scale(gamma, ctx.offset).to(acc)
            grad_input, sums = kernels.implementation(grad.device).norm_backward(
                grad, z, rstd, scale, ctx.dim, ctx.center, ctx.in_dtype, needs_gamma or needs_beta
            )
        else:
            grad_input, sums = None, affine_grad_sums(grad, z, ctx.dim, acc)
        grad_gamma = sums[0].to(gamma.dtype).view(gamma.shape) if needs_gamma else None
        grad_beta = sums[1].to(beta.dtype).view(beta.shape) if needs_beta else None
        return grad_input, grad_gamma, grad_beta, None, None, None, None, None, None, None


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The input dtype, or the autocast dtype when autocast is on for ``x``'s device."""
    compute = autocast_dtype(x) if x.dtype in _AUTOCAST_INPUTS else None
    return compute or x.dtype


def _checked_size(
    name: str,
    x: object,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> int:
    """The number of elements normalized together, once the arguments are known to make sense (clear errors)."""
    check_float_tensor(name, x)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or x.shape[-len(shape) :] != shape:  # also where x has fewer dimensions: a shorter shape
        raise ValueError(
            f"{name}: normalized_shape {list(shape)} must match the trailing dimensions of the input, "
            f"got input of shape {list(x.shape)}"
        )
    dim = math.prod(shape)
    if weight is not None and weight.numel() != dim:
        raise ValueError(f"{name}: weight of shape {list(weight.shape)} does not match normalized_shape")
    if bias is not None and bias.numel() != dim:
        raise ValueError(f"{name}: bias of shape {list(bias.shape)} does not match normalized_shape")
    if not eps > 0:
        raise ValueError(f"{name}: eps must be positive, got {eps}")
    return dim


def memory_sharing_norm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    eps: float,
    center: bool,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    name: str = "memory_sharing_norm",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, z)``: the norm's stock output ``y = (weight + weight_offset) * z + bias`` and the affine-free ``z``
    it saves (``y`` is ``z`` with no affine; ``None`` where it saves ``y`` itself, see :func:`max_exact_columns`,
    and where it saves nothing on CPU: an eval forward writes ``y`` alone). LayerNorm with ``center``, else
    RMSNorm."""
    dim = _checked_size(name, x, normalized_shape, weight, bias, eps)
    out_dtype = output_dtype(x)
    affine = weight is not None or bias is not None
    if x.numel() == 0:  # nothing to normalize (no rows, or rows of 0 elements): as stock, an empty output
        z = x.to(dtype=out_dtype, copy=True)
        return (torch_ops.affine(z, *affine_values(x.dtype, weight, bias, weight_offset)) if affine else z), z
    x = x.contiguous()
    eps, weight_offset = float(eps), float(weight_offset)
    if torch.is_grad_enabled() and (
        x.requires_grad or (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad)
    ):
        max_exact = max_exact_columns(x, weight, bias, dim)
        args = (x, weight, bias, max_exact, dim, eps, center, out_dtype, weight_offset, name)
        if kernels.autograd_in_cpp(x):
            y, z = library.OPS.ms_norm.default(*args)
            return (y, z) if affine else (y, y)
        out = MemorySharingNormFunction.apply(*args)
        return out if affine else (out, out)
    impl = kernels.implementation(x.device)
    if not affine:
        z, _ = impl.norm_forward(x, dim, eps, center, out_dtype)
        return z, z
    if writes_output_alone(x):  # nothing is saved, so nothing needs z: y alone, one tensor written as stock's
        scale, shift = output_affine(x.dtype, weight, bias, weight_offset)
        y, _, _ = impl.norm_output_forward(x, dim, eps, center, out_dtype, scale, shift, _NO_COLUMNS)
        return y, None
    y, z, _ = impl.norm_affine_forward(
        x, dim, eps, center, out_dtype, *affine_values(x.dtype, weight, bias, weight_offset)
    )
    return y, z


def ms_layer_norm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    eps: float = 1e-5,
    *,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.layer_norm`` that saves only its affine-free output and an fp32 rstd per row."""
    return memory_sharing_norm(x, normalized_shape, eps, True, weight, bias, name="ms_layer_norm")[0]


def ms_rms_norm(
    x: torch.Tensor, normalized_shape: int | Sequence[int], eps: float = 1e-6, *, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.rms_norm`` that saves only its affine-free output and an fp32 rstd per row."""
    return memory_sharing_norm(x, normalized_shape, eps, False, weight, name="ms_rms_norm")[0]
