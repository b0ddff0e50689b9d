"""Pure-PyTorch reference implementation of the low-memory kernels.

Every backend (this one, the C++ and CUDA extensions, and the Triton kernels) implements the
same functions with the same contract, so the autograd functions in
:mod:`lightning_lowmem.ops` never know which one runs:

- ``act_codes(x, thresholds) -> packed``: the uint8 buffer of ``ceil(numel*k/8)`` bytes holding
  ``code = sum(x > t_i)`` for every element in row-major order. With ``n = len(thresholds)``
  (ascending) codes take ``k = storage_bits(n)`` bits: 1 for one threshold, 2 for two or three, 4
  for four to fifteen (3-bit tables pack as 4); ``8/k`` codes per byte, element ``i`` in bits
  ``k*(i % (8/k))`` of byte ``i // (8/k)`` (the legacy 2-bit layout is ``n = 3``). Thresholds are
  compared in fp32 (fp64 for fp64 input). The activation itself is no kernel's business: the op
  computes it with the stock PyTorch function, so any activation works with the codes.
- ``act_forward(x, kind, thresholds) -> (y, packed)``: for a contiguous ``x``, ``y`` is ``stock_activation(x, kind)`` bit
  for bit (``kind``: ``"silu"``, ``"gelu"`` or ``"gelu_tanh"``) and ``packed`` is ``act_codes(x,
  thresholds)``; a backend may compute both in one pass (the CPU kernels do for fp32 SiLU).
- ``act_backward(grad, packed, levels) -> grad_input``: ``grad * levels[code]``, computed in
  fp32 (fp64 for fp64 grads) and returned in ``grad``'s dtype and shape; ``len(levels)`` is
  ``len(thresholds) + 1``, which fixes the storage bits.
- ``norm_forward(x, dim, eps, center, out_dtype) -> (z, rstd)``: ``x`` is contiguous and
  normalized over its trailing ``dim`` elements; ``z`` (shape of ``x``, ``out_dtype``) is the
  affine-free output and ``rstd`` (one per row, fp32, fp64 for fp64 input) the reciprocal
  standard deviation. ``center`` selects LayerNorm (True) or RMSNorm (False).
- ``norm_affine_forward(x, dim, eps, center, out_dtype, scale, shift) -> (y, z, rstd)``: ``norm_forward``
  and the norm's output ``y = scale * z + shift`` (``dim`` values each in ``rstd``'s dtype, either None
  for none but not both), computed in that dtype from ``z`` as stored (rounded to ``out_dtype``) and
  returned in ``out_dtype``: what a stock affine of ``z`` gives, to one rounding (a compiler may fuse the
  multiply-add; the CPU kernels write ``y`` in the pass that writes ``z``).
- ``norm_backward(grad, z, rstd, scale, dim, center, dtype, column_sums) -> (grad_input, sums)``:
  the gradients of ``y = scale * z + beta`` (the norm with its affine; ``grad`` is ``dL/dy`` in
  ``z``'s dtype): the paper's algorithms 2-3 applied to ``grad * scale`` (``scale``: ``dim``
  values in the accumulate dtype, or None for none), from the saved output and rstd only,
  returned in ``dtype``; with ``column_sums``, ``sums`` holds ``sum(grad * z)`` and ``sum(grad)``
  over the rows (the gradients of ``gamma`` and ``beta``; shape ``(2, dim)``, accumulate dtype),
  else it is empty. One pass computes what stock LayerNorm's backward computes.
- ``norm_exact_columns(scale, shift) -> columns``: the columns where ``z = (y - shift) / scale`` loses
  precision (ascending int64 indices; how many depends on the values): ``scale`` 0, or ``|shift| >
  |scale|`` (a missing scale is 1).
- ``norm_output_forward(x, dim, eps, center, out_dtype, scale, shift, columns) -> (y, rstd, exact)``:
  ``norm_affine_forward`` for a norm that saves its output ``y`` rather than ``z`` (a frozen affine): no
  ``z`` is written, ``y`` is rounded once, from ``z`` unrounded (as stock's), and ``exact`` (rows x
  ``len(columns)``, ``out_dtype``) holds ``z`` at the ``columns`` (ascending int64 indices, each once:
  the affine's ``norm_exact_columns``).
- ``norm_output_backward(grad, y, rstd, scale, shift, columns, exact, dim, center, dtype) -> grad_input``:
  ``norm_backward``'s input gradient with ``z = (y - shift) / scale`` rebuilt from the saved output, except
  at ``columns`` (ascending int64 indices, each once), whose ``z`` is ``exact``. A compiled kernel reads ``y``
  where the other reads ``z``.
- ``gated_backward(grad, gate, second, kind, act) -> (grad_gate, grad_up)``: gradients of
  ``h = act(gate) * up`` (all tensors one dtype and shape; ``kind`` is ``"silu"``, ``"gelu"`` or
  ``"gelu_tanh"``), computed in fp32 (fp64 for fp64) with ``act'`` evaluated from ``gate``. With
  ``act=None``, ``second`` is ``up`` and ``act`` is evaluated from ``gate`` too (rounded to the
  dtype, as the forward's product saw it). Otherwise ``act`` is the forward's own ``act(gate)``
  tensor and ``second`` the output ``h``, from which ``up = h / act`` (0 where ``act == 0``): only
  the very bits the forward multiplied with recover ``up`` to rounding (a recomputed ``act`` one
  ulp off costs ~1e-5 relative error in GELU's negative tail).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lightning_lowmem.registry.activations import ACTIVATIONS


def storage_bits(count: int) -> int:
    """Bits per code for ``count`` thresholds: 1, 2 or 4 (a 3-bit table packs as 4)."""
    if count == 1:
        return 1
    if 2 <= count <= 3:
        return 2
    if 4 <= count <= 15:
        return 4
    raise ValueError(f"expected 1 to 15 thresholds (1-4 bit codes), got {count}")


def level_bits(count: int) -> int:
    """Bits per code for a table of ``count`` levels (one more than thresholds): 1, 2 or 4."""
    if not 2 <= count <= 16:
        raise ValueError(f"expected 2 to 16 levels (1-4 bit codes), got {count}")
    return storage_bits(count - 1)


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` codes of ``storage_bits`` ``bits``: ``ceil(numel * k / 8)``."""
    return (numel * bits + 7) // 8


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; every other float type computes in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_STOCK_BY_KIND = {entry.kernel: entry.stock for entry in ACTIVATIONS.values() if entry.kernel is not None}
KINDS = tuple(_STOCK_BY_KIND)
"""The activation ids the kernels know (each a registry entry's ``kernel``): fused forward, gated backward."""


def stock_activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The stock PyTorch activation of kernel id ``kind`` (the registry's function): what the ops' forward returns."""
    stock = _STOCK_BY_KIND.get(kind)
    if stock is None:
        raise ValueError(f"unknown activation kind {kind!r}; expected one of {', '.join(KINDS)}")
    return stock(x)


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def pack_codes(codes: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """Pack a flat uint8 tensor of ``bits``-bit codes, ``8/bits`` per byte (the last byte zero-padded)."""
    per = 8 // bits
    pad = (-codes.numel()) % per
    if pad:
        codes = F.pad(codes, (0, pad))
    groups = codes.view(-1, per) << _shifts(bits, codes.device)
    packed = groups[:, 0].clone()
    for column in range(1, per):
        packed |= groups[:, column]
    return packed


def unpack_codes(packed: torch.Tensor, numel: int, bits: int = 2) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: a flat int64 tensor of ``numel`` codes."""
    codes = (packed.unsqueeze(1) >> _shifts(bits, packed.device)) & ((1 << bits) - 1)
    return codes.view(-1)[:numel].long()


def act_codes(x: torch.Tensor, thresholds: tuple[float, ...]) -> torch.Tensor:
    bits = storage_bits(len(thresholds))
    xa = x.reshape(-1).to(accumulate_dtype(x.dtype))
    codes = torch.zeros(xa.shape, dtype=torch.uint8, device=x.device)
    for threshold in thresholds:
        codes += xa > threshold
    return pack_codes(codes, bits)


def act_forward(x: torch.Tensor, kind: str, thresholds: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    return stock_activation(x, kind).contiguous(), act_codes(x, thresholds)


def act_backward(grad: torch.Tensor, packed: torch.Tensor, levels: tuple[float, ...]) -> torch.Tensor:
    bits = level_bits(len(levels))
    if packed.numel() != packed_bytes(grad.numel(), bits):
        raise ValueError(f"act_backward: {packed.numel()} packed bytes do not hold {grad.numel()} codes of {bits} bits")
    acc = accumulate_dtype(grad.dtype)
    table = torch.tensor(levels, dtype=acc, device=grad.device)
    derivative = table[unpack_codes(packed, grad.numel(), bits)].view(grad.shape)
    return (grad.to(acc) * derivative).to(grad.dtype)


def activation_and_slope(g: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``act(g)`` and ``act'(g)`` by the formulas the compiled kernels use (csrc/lowmem_math.h)."""
    if kind == "silu":
        s = torch.sigmoid(g)
        return g * s, s * (1 + g * (1 - s))
    if kind == "gelu":
        cdf = 0.5 * (1 + torch.erf(g * math.sqrt(0.5)))
        return g * cdf, cdf + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
    k, c = math.sqrt(2 / math.pi), 0.044715
    t = torch.tanh(k * (g + c * g * g * g))
    return 0.5 * g * (1 + t), 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * c * g * g)


def check_gated(
    grad: torch.Tensor, gate: torch.Tensor, second: torch.Tensor, kind: str, act: torch.Tensor | None
) -> None:
    """The arguments of gated_backward make sense: a known kind, one shape and dtype for all tensors."""
    if kind not in KINDS:
        raise ValueError(f"gated_backward: unknown activation kind {kind!r}; expected one of {', '.join(KINDS)}")
    tensors = (grad, gate, second) if act is None else (grad, gate, second, act)
    if any(t.shape != grad.shape or t.dtype != grad.dtype for t in tensors):
        described = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)
        raise ValueError(f"gated_backward: grad, gate, second (and act) must share shape and dtype, got {described}")


def gated_backward(
    grad: torch.Tensor, gate: torch.Tensor, second: torch.Tensor, kind: str, act: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    check_gated(grad, gate, second, kind, act)
    acc = accumulate_dtype(grad.dtype)
    value, slope = activation_and_slope(gate.to(acc), kind)
    value = (value.to(grad.dtype) if act is None else act).to(acc)  # as the forward's product saw it
    up = second.to(acc)
    if act is not None:
        up = torch.where(value != 0, up / value, torch.zeros_like(up))
    grad_acc = grad.to(acc)
    return (grad_acc * up * slope).to(grad.dtype), (grad_acc * value).to(grad.dtype)


def norm_forward(
    x: torch.Tensor, dim: int, eps: float, center: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    xa = x.reshape(-1, dim).to(accumulate_dtype(x.dtype))
    if center:
        xa = xa - xa.mean(-1, keepdim=True)
    rstd = torch.rsqrt(xa.square().mean(-1, keepdim=True) + eps)
    z = (xa * rstd).to(out_dtype).view(x.shape)
    return z, rstd.view(-1)


def affine(z: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None) -> torch.Tensor:
    """``scale * z + shift`` in the dtype of ``scale`` / ``shift``, returned in ``z``'s (either may be None)."""
    out = z.to((scale if scale is not None else shift).dtype)
    if scale is not None and shift is not None:
        out = torch.addcmul(shift, out, scale)  # one pass
    elif scale is not None:
        out = out * scale
    else:
        out = out + shift
    return out.to(z.dtype)


def check_affine(op: str, dim: int, dtype: torch.dtype, scale: torch.Tensor | None, shift: torch.Tensor | None) -> None:
    """A scale or a shift (or both) of ``dim`` values of the accumulate ``dtype`` each, else an error naming ``op``."""
    if scale is None and shift is None:
        raise ValueError(f"{op}: needs a scale or a shift")
    acc = accumulate_dtype(dtype)
    for name, values in (("scale", scale), ("shift", shift)):
        if values is not None and (values.numel() != dim or values.dtype != acc):
            raise ValueError(f"{op}: expected {dim} {name} values of dtype {acc}, got {values.numel()} of {values.dtype}")


def with_affine(norm_forward: Callable) -> Callable:
    """The ``norm_affine_forward`` of a backend whose norm kernel does not fuse the affine: ``norm_forward``,
    then :func:`affine` as a PyTorch pass."""

    def norm_affine_forward(
        x: torch.Tensor,
        dim: int,
        eps: float,
        center: bool,
        out_dtype: torch.dtype,
        scale: torch.Tensor | None,
        shift: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_affine("norm_affine_forward", dim, x.dtype, scale, shift)
        z, rstd = norm_forward(x, dim, eps, center, out_dtype)
        return affine(z, scale, shift), z, rstd

    return norm_affine_forward


norm_affine_forward = with_affine(norm_forward)


def norm_exact_columns(scale: torch.Tensor | None, shift: torch.Tensor | None) -> torch.Tensor:
    """The contract's columns: beyond them, ``y``'s rounding error over ``scale`` exceeds ``z``'s own for ``|z| <= 1``."""
    if scale is None and shift is None:
        raise ValueError("norm_exact_columns: needs a scale or a shift")
    values = shift if scale is None else scale
    bad = torch.zeros_like(values, dtype=torch.bool) if scale is None else scale == 0
    if shift is not None:
        bad |= shift.abs() > (1.0 if scale is None else scale.abs())
    return bad.nonzero().view(-1)


def norm_output_forward(
    x: torch.Tensor,
    dim: int,
    eps: float,
    center: bool,
    out_dtype: torch.dtype,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    columns: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_affine("norm_output_forward", dim, x.dtype, scale, shift)
    z, rstd = norm_forward(x, dim, eps, center, accumulate_dtype(x.dtype))  # unrounded
    return affine(z, scale, shift).to(out_dtype), rstd, z.view(-1, dim)[:, columns].to(out_dtype)


def norm_output_backward(
    grad: torch.Tensor,
    y: torch.Tensor,
    rstd: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    columns: torch.Tensor,
    exact: torch.Tensor,
    dim: int,
    center: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    z = y.reshape(-1, dim).to(rstd.dtype)
    z = z if shift is None else z - shift
    z = z if scale is None else z / scale
    z = z.index_copy(1, columns, exact.to(rstd.dtype))
    return norm_backward(grad, z.view(y.shape), rstd, scale, dim, center, dtype, False)[0]


def affine_grad_sums(grad: torch.Tensor, z: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``sum(grad * z)`` and ``sum(grad)`` over the rows, in ``dtype``: a norm's gamma and beta gradients."""
    grad_rows, z_rows = grad.reshape(-1, dim).to(dtype), z.reshape(-1, dim).to(dtype)
    return torch.stack(((grad_rows * z_rows).sum(0), grad_rows.sum(0)))


def norm_backward(
    grad: torch.Tensor,
    z: torch.Tensor,
    rstd: torch.Tensor,
    scale: torch.Tensor | None,
    dim: int,
    center: bool,
    dtype: torch.dtype,
    column_sums: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    g = grad.reshape(-1, dim).to(rstd.dtype)
    za = z.reshape(-1, dim).to(rstd.dtype)
    sums = affine_grad_sums(grad, z, dim, rstd.dtype) if column_sums else rstd.new_empty(0)
    g = g if scale is None else g * scale
    projection = (g * za).mean(-1, keepdim=True)
    if center:
        g = g - g.mean(-1, keepdim=True)
    grad_input = rstd.unsqueeze(-1) * (g - za * projection)
    return grad_input.to(dtype).reshape(z.shape), sums
