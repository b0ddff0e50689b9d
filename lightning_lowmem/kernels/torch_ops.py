"""The kernel ops, each declared once here by its reference: the executable specification every backend meets.

Each op is a typed function whose docstring says what it computes and whose body checks its arguments and computes
it in PyTorch. :func:`~lightning_lowmem.kernels.library.declare` makes it the operator ``torch.ops.lowmem.<name>``
(schema, fallback and fake kernel from this one function); the C++/CUDA extensions and the Triton kernels register
faster implementations of the same operators. The reference runs wherever no compiled backend does, and is what the
tests hold every other backend to.

Codes: with ``n = len(thresholds)`` (ascending) a code takes ``k = storage_bits(n)`` bits: 1 for one
threshold, 2 for two or three, 4 for four to fifteen (3-bit tables pack as 4); ``8/k`` codes per byte,
element ``i`` in bits ``k*(i % (8/k))`` of byte ``i // (8/k)``. Activation ``kind``: a kernel id of the
activation registry (``"silu"``, ``"gelu"``, ``"gelu_tanh"``). fp64 inputs compute in fp64, every other
dtype in fp32 (the accumulate dtype).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lightning_lowmem.kernels.library import declare
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


@declare()
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


@declare()
def act_codes(x: torch.Tensor, thresholds: Sequence[float]) -> torch.Tensor:
    """The uint8 buffer of ``ceil(numel*k/8)`` bytes holding ``code = sum(x > t_i)`` for every element in
    row-major order, thresholds compared in the accumulate dtype. The activation itself is no kernel's
    business: the op computes it with the stock PyTorch function, so any activation works with the codes."""
    bits = storage_bits(len(thresholds))
    xa = x.reshape(-1).to(accumulate_dtype(x.dtype))
    codes = torch.zeros(xa.shape, dtype=torch.uint8, device=x.device)
    for threshold in thresholds:
        codes += xa > threshold
    return pack_codes(codes, bits)


@declare()
def act_forward(x: torch.Tensor, kind: str, thresholds: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, packed)`` for a contiguous ``x``: ``y`` is the stock activation ``kind`` bit for bit and
    ``packed`` is ``act_codes(x, thresholds)``; a backend may compute both in one pass."""
    return stock_activation(x, kind).contiguous(), act_codes(x, thresholds)


@declare()
def act_backward(grad: torch.Tensor, packed: torch.Tensor, levels: Sequence[float]) -> torch.Tensor:
    """``grad * levels[code]`` in the accumulate dtype, returned in ``grad``'s dtype and shape;
    ``len(levels)`` is ``len(thresholds) + 1``, which fixes the storage bits."""
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
    grad: torch.Tensor,
    gate: torch.Tensor,
    second: torch.Tensor,
    kind: str,
    act: torch.Tensor | None,
    columns: torch.Tensor | None = None,
    up_at: torch.Tensor | None = None,
) -> None:
    """The arguments of gated_backward make sense: a known kind, one shape and dtype for all tensors, exceptions
    (both or neither) of a product with ``act``."""
    if kind not in KINDS:
        raise ValueError(f"gated_backward: unknown activation kind {kind!r}; expected one of {', '.join(KINDS)}")
    tensors = (grad, gate, second) if act is None else (grad, gate, second, act)
    if any(t.shape != grad.shape or t.dtype != grad.dtype for t in tensors):
        described = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)
        raise ValueError(f"gated_backward: grad, gate, second (and act) must share shape and dtype, got {described}")
    if (columns is None) != (up_at is None) or (columns is not None and act is None):
        raise ValueError("gated_backward: columns and up_at come together, and with act (gated_exceptions' output)")
    if columns is not None:
        rows, _ = rows_and_columns(grad)
        if (
            columns.dtype != torch.int32
            or columns.dim() != 2
            or columns.shape[0] != rows
            or up_at.shape != columns.shape
        ):
            raise ValueError(
                f"gated_backward: expected int32 columns and up_at of one shape ({rows}, slots), got "
                f"{tuple(columns.shape)} {columns.dtype} and {tuple(up_at.shape)} {up_at.dtype}"
            )
        if up_at.dtype != grad.dtype:
            raise ValueError(f"gated_backward: up_at must be {grad.dtype}, got {up_at.dtype}")


def rows_and_columns(x: torch.Tensor) -> tuple[int, int]:
    """``x`` as rows of its last dimension (a scalar: one row of one)."""
    return (math.prod(x.shape[:-1]), x.shape[-1]) if x.dim() else (1, 1)


def check_gated_exceptions(act: torch.Tensor, up: torch.Tensor, slots: int) -> None:
    if act.shape != up.shape or act.dtype != up.dtype or not act.is_floating_point():
        raise ValueError(
            f"gated_exceptions: act and up must be floating tensors of one shape and dtype, got {tuple(act.shape)} "
            f"{act.dtype} and {tuple(up.shape)} {up.dtype}"
        )
    if slots < 0:
        raise ValueError(f"gated_exceptions: slots must be >= 0, got {slots}")


@declare()
def gated_exceptions(act: torch.Tensor, up: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(columns, up_at)`` where ``act == 0`` (``act`` the forward's ``act(gate)``, ``up`` its other factor: one
    shape and dtype): there ``h = act * up`` holds nothing of ``up``. Per row (the last dimension), the first
    ``slots`` such columns in ascending order (int32, ``-1`` in the slots past the row's last) and ``up`` at them
    (``up``'s dtype, 0 past the last), each of shape ``(rows, slots)``. A fixed size: nothing read back to the
    host; one pass over ``act`` (``up`` is read at the columns only)."""
    check_gated_exceptions(act, up, slots)
    rows, cols = rows_and_columns(act)
    zero = (act == 0).reshape(rows, cols)
    rank = zero.cumsum(-1)  # each zero's 1-based place in its row
    slot = torch.where(zero & (rank <= slots), rank - 1, slots)  # the rest: past the slots
    index = torch.arange(cols, dtype=torch.int32, device=act.device).expand(rows, cols)
    return _scattered(index, slot, slots, -1), _scattered(up.reshape(rows, cols), slot, slots, 0)


def _scattered(values: torch.Tensor, at: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """Rows of ``width`` filled with ``fill``, ``values`` scattered into them at columns ``at`` (those at ``width``
    dropped: they land in a scratch column sliced off)."""
    rows = values.new_full((values.shape[0], width + 1), fill)
    return rows.scatter_(1, at, values)[:, :width].contiguous()


@declare()
def gated_backward(
    grad: torch.Tensor,
    gate: torch.Tensor,
    second: torch.Tensor,
    kind: str,
    act: torch.Tensor | None,
    columns: torch.Tensor | None = None,
    up_at: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_gate, grad_up)`` of ``h = act(gate) * up`` (all tensors one dtype and shape), computed in the
    accumulate dtype with ``act'`` evaluated from ``gate``. With ``act=None``, ``second`` is ``up`` and
    ``act`` is evaluated from ``gate`` too (rounded to the dtype, as the forward's product saw it).
    Otherwise ``act`` is the forward's own ``act(gate)`` tensor and ``second`` the output ``h``, from which
    ``up = h / act`` where ``act != 0``: only the very bits the forward multiplied with recover ``up``
    to rounding (a recomputed ``act`` one ulp off costs ~1e-5 relative error in GELU's negative tail). Where
    ``act == 0``, ``up`` is ``up_at`` at the row's slot holding that column (``columns`` and ``up_at``: the
    forward's :meth:`gated_exceptions`), else 0."""
    check_gated(grad, gate, second, kind, act, columns, up_at)
    acc = accumulate_dtype(grad.dtype)
    value, slope = activation_and_slope(gate.to(acc), kind)
    value = (value.to(grad.dtype) if act is None else act).to(acc)  # as the forward's product saw it
    up = second.to(acc)
    if act is not None:
        kept = torch.zeros_like(up)
        if columns is not None and columns.numel():
            cols = rows_and_columns(grad)[1]
            at = torch.where(columns >= 0, columns, cols).long()  # unused slots: dropped
            kept = _scattered(up_at.to(acc), at, cols, 0).reshape(up.shape)
        up = torch.where(value != 0, up / value, kept)
    grad_acc = grad.to(acc)
    return (grad_acc * up * slope).to(grad.dtype), (grad_acc * value).to(grad.dtype)


@declare()
def norm_forward(
    x: torch.Tensor, dim: int, eps: float, center: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, rstd)`` of a contiguous ``x`` normalized over its trailing ``dim`` elements: ``z`` (shape of
    ``x``, ``out_dtype``) the affine-free output, ``rstd`` (one per row, accumulate dtype) the reciprocal
    standard deviation. ``center``: LayerNorm (True) or RMSNorm (False)."""
    xa = x.reshape(-1, dim).to(accumulate_dtype(x.dtype))
    if center:
        xa = xa - xa.mean(-1, keepdim=True)
    rstd = torch.rsqrt(xa.square().mean(-1, keepdim=True) + eps)
    z = (xa * rstd).to(out_dtype).view(x.shape)
    return z, rstd.view(-1)


def affine(
    z: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``scale * z + shift`` in the dtype of ``scale`` / ``shift``, returned in ``dtype`` (default ``z``'s; either of
    ``scale`` and ``shift`` may be None)."""
    out = z.to((scale if scale is not None else shift).dtype)
    if scale is not None and shift is not None:
        out = torch.addcmul(shift, out, scale)  # one pass
    elif scale is not None:
        out = out * scale
    else:
        out = out + shift
    return out.to(dtype or z.dtype)


def check_affine(
    op: str, dim: int, dtype: torch.dtype, scale: torch.Tensor | None, shift: torch.Tensor | None, widens: bool = False
) -> None:
    """A scale or a shift (or both) of ``dim`` values of the accumulate ``dtype`` each (or of ``dtype`` itself where
    the op ``widens`` them: the output ops take a frozen parameter as it is), else an error naming ``op``."""
    if scale is None and shift is None:
        raise ValueError(f"{op}: needs a scale or a shift")
    dtypes = dict.fromkeys((accumulate_dtype(dtype), dtype) if widens else (accumulate_dtype(dtype),))
    for name, values in (("scale", scale), ("shift", shift)):
        if values is not None and (values.numel() != dim or values.dtype not in dtypes):
            expected = " or ".join(map(str, dtypes))
            raise ValueError(
                f"{op}: expected {dim} {name} values of dtype {expected}, got {values.numel()} of {values.dtype}"
            )


def _widened(values: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if values is None else values.to(dtype)


@declare()
def norm_affine_forward(
    x: torch.Tensor,
    dim: int,
    eps: float,
    center: bool,
    out_dtype: torch.dtype,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, z, rstd)``: ``norm_forward`` and the norm's output ``y = scale * z + shift`` (``dim`` values
    each in ``rstd``'s dtype, either None for none but not both), computed in that dtype from ``z`` as
    stored (rounded to ``out_dtype``) and returned in ``out_dtype``: what a stock affine of ``z`` gives, to
    one rounding (a compiler may fuse the multiply-add; the CPU kernels write ``y`` in the pass that
    writes ``z``)."""
    check_affine("norm_affine_forward", dim, x.dtype, scale, shift)
    z, rstd = norm_forward(x, dim, eps, center, out_dtype)
    return affine(z, scale, shift), z, rstd


def _norm_exact_columns_fake(scale: torch.Tensor | None, shift: torch.Tensor | None) -> torch.Tensor:
    values = scale if scale is not None else shift
    torch._check(values is not None, lambda: "norm_exact_columns: needs a scale or a shift")
    count = torch.library.get_ctx().new_dynamic_size()  # how many depends on the values
    torch._check(count <= values.numel())
    return values.new_empty(count, dtype=torch.long)


@declare(fake=_norm_exact_columns_fake)
def norm_exact_columns(scale: torch.Tensor | None, shift: torch.Tensor | None) -> torch.Tensor:
    """The columns where ``z = (y - shift) / scale`` loses precision (ascending int64 indices; how many
    depends on the values): ``scale`` 0, or ``|shift| > |scale|`` (a missing scale is 1). Beyond them, ``y``'s
    rounding error over ``scale`` exceeds ``z``'s own for ``|z| <= 1``."""
    if scale is None and shift is None:
        raise ValueError("norm_exact_columns: needs a scale or a shift")
    values = shift if scale is None else scale
    bad = torch.zeros_like(values, dtype=torch.bool) if scale is None else scale == 0
    if shift is not None:
        bad |= shift.abs() > (1.0 if scale is None else scale.abs())
    return bad.nonzero().view(-1)


@declare()
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
    """``(y, rstd, exact)``: ``norm_affine_forward`` for a norm that saves its output ``y`` rather than ``z``
    (a frozen affine): no ``z`` is written, ``y`` is rounded once, from ``z`` unrounded (as stock's), and
    ``exact`` (rows x ``len(columns)``, ``out_dtype``) holds ``z`` at the ``columns`` (ascending int64
    indices, each once: the affine's ``norm_exact_columns``). ``scale`` and ``shift`` may be in ``x``'s own dtype
    (a frozen parameter as it is), widened to the accumulate dtype."""
    check_affine("norm_output_forward", dim, x.dtype, scale, shift, widens=True)
    acc = accumulate_dtype(x.dtype)
    z, rstd = norm_forward(x, dim, eps, center, acc)  # unrounded
    y = affine(z, _widened(scale, acc), _widened(shift, acc))
    return y.to(out_dtype), rstd, z.view(-1, dim)[:, columns].to(out_dtype)


@declare()
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
    """``norm_backward``'s input gradient with ``z = (y - shift) / scale`` rebuilt from the saved output,
    except at ``columns`` (ascending int64 indices, each once), whose ``z`` is ``exact``. ``scale`` and ``shift``
    as ``norm_output_forward`` takes them."""
    if scale is not None or shift is not None:  # neither: z is y
        check_affine("norm_output_backward", dim, y.dtype, scale, shift, widens=True)
    scale, shift = _widened(scale, rstd.dtype), _widened(shift, rstd.dtype)
    z = y.reshape(-1, dim).to(rstd.dtype)
    z = z if shift is None else z - shift
    z = z if scale is None else z / scale
    z = z.index_copy(1, columns, exact.to(rstd.dtype))
    return norm_backward(grad, z.view(y.shape), rstd, scale, dim, center, dtype, False)[0]


def affine_grad_sums(grad: torch.Tensor, z: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``sum(grad * z)`` and ``sum(grad)`` over the rows, in ``dtype``: a norm's gamma and beta gradients."""
    grad_rows, z_rows = grad.reshape(-1, dim).to(dtype), z.reshape(-1, dim).to(dtype)
    return torch.stack(((grad_rows * z_rows).sum(0), grad_rows.sum(0)))


@declare()
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
    """``(grad_input, sums)``: the gradients of ``y = scale * z + beta`` (``grad`` is ``dL/dy`` in ``z``'s
    dtype): the paper's algorithms 2-3 applied to ``grad * scale`` (``dim`` values in the accumulate dtype,
    or None), from the saved output and rstd only, returned in ``dtype``; with ``column_sums``, ``sums``
    holds ``sum(grad * z)`` and ``sum(grad)`` over the rows (the gradients of ``gamma`` and ``beta``; shape
    ``(2, dim)``, accumulate dtype), else it is empty. One pass computes what stock LayerNorm's backward
    computes."""
    g = grad.reshape(-1, dim).to(rstd.dtype)
    za = z.reshape(-1, dim).to(rstd.dtype)
    sums = affine_grad_sums(grad, z, dim, rstd.dtype) if column_sums else rstd.new_empty(0)
    g = g if scale is None else g * scale
    projection = (g * za).mean(-1, keepdim=True)
    if center:
        g = g - g.mean(-1, keepdim=True)
    grad_input = rstd.unsqueeze(-1) * (g - za * projection)
    return grad_input.to(dtype).reshape(z.shape), sums


_WORD = 0xFFFFFFFF
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low words of ``a * b`` for 32-bit ``a`` and ``b`` (int64 tensors): in 16-bit halves of ``b``, so
    that no partial product leaves int64."""
    low, high = a * (b & 0xFFFF), a * (b >> 16)
    total = low + ((high & 0xFFFF) << 16)
    return (high >> 16) + (total >> 32), total & _WORD


def philox(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """The four Philox4x32-10 words of each counter (int64) under key ``seed``, ``(len(counters), 4)`` int64:
    the rounds of ``philox4x32`` in ``csrc/lowmem_math.h``."""
    c0, c1 = counters & _WORD, counters >> 32
    c2 = c3 = torch.zeros_like(counters)
    k0, k1 = seed & _WORD, (seed >> 32) & _WORD
    for _ in range(10):
        hi0, lo0 = _mulhilo(_PHILOX_ROUND[0], c0)
        hi1, lo1 = _mulhilo(_PHILOX_ROUND[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_KEY[0]) & _WORD, (k1 + _PHILOX_KEY[1]) & _WORD
    return torch.stack((c0, c1, c2, c3), dim=1)


def dropout_threshold(p: float) -> int:
    """The smallest kept word for drop probability ``p``: ``p * 2^32`` rounded (as ``dropout_threshold`` in C++)."""
    return int(min(math.floor(p * 4294967296.0 + 0.5), _WORD))


def check_dropout(x: torch.Tensor, p: float, seed: torch.Tensor) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    if seed.dtype != torch.int64 or seed.numel() not in (1, 2) or seed.device != x.device or not seed.is_contiguous():
        raise ValueError(
            f"dropout: seed must be one or two int64 values (a key, and a first counter) on {x.device}, got "
            f"{seed.numel()} of {seed.dtype}"
        )


def _dropout_fake(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # the reference reads the seed


@declare(fake=_dropout_fake)
def dropout(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """``x * keep / (1 - p)`` (``0 <= p < 1``) in the accumulate dtype, returned contiguous in ``x``'s dtype:
    element ``i`` (row-major) is kept when word ``i % 4`` of the Philox4x32-10 block of counter ``first + i // 4``
    under key ``key`` is at least ``round(p * 2^32)`` (``csrc/lowmem_math.h``: ATen's and Triton's Philox, so
    every backend draws the same mask). ``seed``: int64 ``[key]`` (``first`` 0) or ``[key, first]`` on ``x``'s
    device (the C++ autograd draws a GPU's key and counters from its generator, as ATen's dropout does). A
    backward applies the forward's mask by calling it on the gradient with the same seed: nothing but the seed
    is saved."""
    check_dropout(x, p, seed)
    key, first = (*seed.tolist(), 0)[:2]
    counters = torch.arange(first, first + (x.numel() + 3) // 4, dtype=torch.int64, device=x.device)
    keep = philox(key, counters).view(-1)[: x.numel()].view(x.shape) >= dropout_threshold(p)
    acc = accumulate_dtype(x.dtype)
    kept = x.contiguous().to(acc) * (1.0 / (1.0 - p))
    return torch.where(keep, kept, torch.zeros((), dtype=acc, device=x.device)).to(x.dtype)


def _dropout_input_and_grad_fake(
    x: torch.Tensor, scale: object, shift: object, dtype: torch.dtype, grad: torch.Tensor, *mask: object
) -> tuple[torch.Tensor, torch.Tensor]:
    read = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    return read, torch.empty_like(grad, memory_format=torch.contiguous_format)


@declare(fake=_dropout_input_and_grad_fake)
def dropout_input_and_grad(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    dtype: torch.dtype,
    grad: torch.Tensor,
    p: float,
    seed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A folded dropout's backward in one pass: ``(dropout(rebuilt), dropout(grad))``, both with the mask of
    ``seed`` (:meth:`dropout`). ``rebuilt``, the input the layer read before its mask, is ``x * scale + shift``
    (``scale`` and ``shift`` per feature, the last dimension, in the accumulate dtype of ``dtype``, either None:
    :func:`~lightning_lowmem.kernels.torch_ops.affine`) rounded to ``x``'s dtype, then to ``dtype`` (a norm's output
    as the norm rounded it, read by a layer of another dtype: fp32 adapters on a bf16 model), or ``x`` in ``dtype``
    with neither;
    ``grad`` (``dtype``, ``x``'s shape) is the gradient of what the layer read. What the affine and two ``dropout``
    calls give, with a fused multiply-add where a backend fuses it; one launch where they took three to five."""
    check_dropout(grad, p, seed)
    if x.shape != grad.shape or grad.dtype != dtype:
        raise ValueError(
            f"dropout_input_and_grad: grad must be {dtype} of x's shape {tuple(x.shape)}, got {grad.dtype} "
            f"{tuple(grad.shape)}"
        )
    rebuilt = x if scale is None and shift is None else affine(x, scale, shift)
    return dropout(rebuilt.to(dtype), p, seed), dropout(grad, p, seed)


def check_affine_weight_grad(
    product: torch.Tensor,
    total: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    dtype: torch.dtype,
) -> None:
    if product.dim() != 2 or not product.is_floating_point():
        raise ValueError(f"affine_weight_grad: product must be a floating (out, in) matrix, got {tuple(product.shape)}")
    check_affine("affine_weight_grad", product.shape[1], dtype, scale, shift)
    if (shift is None) != (total is None):
        raise ValueError("affine_weight_grad: total (the gradient's sum) comes with a shift, and only with one")
    if total is not None and (total.shape != product.shape[:1] or total.dtype != product.dtype):
        raise ValueError(
            f"affine_weight_grad: expected {product.shape[0]} total values of dtype {product.dtype}, got "
            f"{tuple(total.shape)} {total.dtype}"
        )


@declare()
def affine_weight_grad(
    product: torch.Tensor,
    total: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A linear's weight gradient where it read a norm's output ``x = z * scale + shift`` and saved ``z``:
    ``product * scale + outer(total, shift)``, with ``product = grad^T @ z`` (out x in, contiguous) and ``total =
    sum(grad)`` over the rows (``out`` values of ``product``'s dtype; None without a shift); ``scale`` and
    ``shift`` per input feature in the accumulate dtype of ``dtype`` (either None, not both). Computed in that
    accumulate dtype and returned in ``dtype`` (the weight's): one pass where a widening copy, a scaling, an
    outer-product add and a narrowing copy took four."""
    check_affine_weight_grad(product, total, scale, shift, dtype)
    out = product.to(accumulate_dtype(dtype))
    if scale is not None:
        out = out * scale
    if shift is not None:
        out = torch.addr(out, total.to(out.dtype), shift)
    return out.to(dtype)


CROSS_ENTROPY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The logits the cross-entropy step takes (its loss and math are fp32 whatever they are)."""


def check_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    row_scale: torch.Tensor | None = None,
    host: bool = True,
) -> None:
    """Clear errors for bad arguments (a target out of bounds: :func:`check_targets`)."""
    check_logit_rows("cross_entropy_grad_", logits, target)
    if row_scale is not None and (
        row_scale.dtype != torch.float32 or row_scale.shape != logits.shape[:1] or row_scale.device != logits.device
    ):
        raise ValueError(f"cross_entropy_grad_: row_scale must be {logits.shape[0]} float32 values on {logits.device}")
    if not 0.0 <= label_smoothing <= 1.0 or softcap < 0:
        raise ValueError(
            f"cross_entropy_grad_: label_smoothing must be in [0, 1] and softcap >= 0, got {label_smoothing}, {softcap}"
        )
    check_targets("cross_entropy_grad_", logits, target, ignore_index, host)


def check_logit_rows(op: str, logits: torch.Tensor, target: torch.Tensor) -> None:
    """Contiguous rows of logits of a dtype the heads take, and an int64 target per row on their device."""
    if logits.dim() != 2 or logits.dtype not in CROSS_ENTROPY_DTYPES or not logits.is_contiguous():
        raise ValueError(
            f"{op}: logits must be contiguous float32, bfloat16 or float16 rows, got {tuple(logits.shape)} {logits.dtype}"
        )
    if target.dtype != torch.int64 or target.shape != logits.shape[:1] or target.device != logits.device:
        raise ValueError(f"{op}: target must be {logits.shape[0]} int64 values on {logits.device}")


def check_targets(op: str, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, host: bool) -> None:
    """Every target not ignored is a class of ``logits``: an ``IndexError`` naming one where ``host`` (reading the
    targets is free), else a device-side assert, as stock's cross-entropy has on a GPU (no synchronisation)."""
    if not logits.shape[1]:
        return
    outside = (target != ignore_index) & ((target < 0) | (target >= logits.shape[1]))
    if not host:
        torch._assert_async(~outside.any(), f"{op}: a target is out of bounds for {logits.shape[1]} classes")
    elif outside.any():
        raise IndexError(f"{op}: target {target[outside][0].item()} is out of bounds for {logits.shape[1]} classes")


def _cross_entropy_grad_fake(logits: torch.Tensor, target: torch.Tensor, *args: object) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.float32)  # the reference reads the targets


@declare(fake=_cross_entropy_grad_fake, mutates=("logits",))
def cross_entropy_grad_(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-row cross-entropy (fp32) of ``logits`` (rows x vocabulary, fp32, bf16 or fp16, contiguous;
    ``softcap > 0``: of ``softcap * tanh(logits / softcap)``, Gemma 2's final capping) against ``target`` (int64
    per row; a row whose target is ``ignore_index`` has loss 0), with ``label_smoothing`` as ``F.cross_entropy``
    takes it; fp32 math whatever the logits' dtype. ``logits`` is overwritten with the loss's gradient with
    respect to it (0 on ignored rows), times ``row_scale`` (fp32, one per row) when given, rounded once to their
    dtype: one chunk of a fused linear + cross-entropy never holds logits and their gradient at once, and a
    bf16 chunk's gradient is what its matmuls read."""
    check_cross_entropy(logits, target, ignore_index, label_smoothing, softcap, row_scale, host=logits.is_cpu)
    rows = logits.float()
    capped = softcap * torch.tanh(rows / softcap) if softcap else rows
    log_probs = torch.log_softmax(capped, dim=-1)
    ignored = target == ignore_index
    picked = log_probs.gather(1, target.masked_fill(ignored, 0).unsqueeze(1)).squeeze(1)
    vocab = logits.shape[1]
    loss = -(1 - label_smoothing) * picked - label_smoothing * log_probs.mean(-1)
    grad = log_probs.exp_() - label_smoothing / vocab
    grad.scatter_add_(
        1, target.masked_fill(ignored, 0).unsqueeze(1), grad.new_full((len(target), 1), label_smoothing - 1)
    )
    if softcap:
        grad.mul_(1 - (capped / softcap).square())
    grad.masked_fill_(ignored.unsqueeze(1), 0.0)
    if row_scale is not None:
        grad.mul_(row_scale.unsqueeze(1))
    logits.copy_(grad)
    return loss.masked_fill(ignored, 0.0)


def check_log_probs(
    op: str,
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    temperature: float,
    *per_row: object,
    host: bool,
) -> None:
    """The checks every backend of the log-prob ops runs: rows of logits, their targets (out of bounds: as
    :func:`check_targets` says, by ``host``), a positive temperature and ``per_row`` (name, values) pairs of one fp32
    value per row (or None)."""
    check_logit_rows(op, logits, target)
    if not temperature > 0:
        raise ValueError(f"{op}: temperature must be positive, got {temperature}")
    for name, values in per_row:
        if values is not None and (values.dtype != torch.float32 or values.shape != target.shape):
            raise ValueError(
                f"{op}: {name} must be {len(target)} float32 values, got {tuple(values.shape)} {values.dtype}"
            )
    check_targets(op, logits, target, ignore_index, host)


def _token_log_probs_fake(logits: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = logits.new_empty(logits.shape[0], dtype=torch.float32)  # the reference reads the targets
    return rows, torch.empty_like(rows), torch.empty_like(rows)


@declare(fake=_token_log_probs_fake)
def token_log_probs(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log_prob, entropy, lse)``, one fp32 value per row of ``logits`` (rows x vocabulary, fp32, bf16 or fp16,
    contiguous) scaled to ``s = logits / temperature``: the log-probability ``s[target] - lse`` of the row's target
    (int64 per row), the entropy ``-sum(p * log p)`` of ``p = softmax(s)``, and ``lse = logsumexp(s)``, in fp32
    whatever the logits' dtype. A row whose target is ``ignore_index`` gives 0 for both (its ``lse`` is still
    computed). One chunk of a fused linear + log-probs head (:func:`lightning_lowmem.ops.linear_log_probs`): what
    its backward needs of a row (``lse``, the entropy), and not its logits."""
    check_log_probs("token_log_probs", logits, target, ignore_index, temperature, host=logits.is_cpu)
    rows = logits.float() / temperature
    lse = torch.logsumexp(rows, dim=1)
    log_p = rows.sub_(lse.unsqueeze(1))
    ignored = target == ignore_index
    picked = log_p.gather(1, target.masked_fill(ignored, 0).unsqueeze(1)).squeeze(1)
    entropy = -(log_p.exp() * log_p).sum(1)
    return picked.masked_fill(ignored, 0.0), entropy.masked_fill(ignored, 0.0), lse


def grad_rows(*values: torch.Tensor | None) -> list[tuple[str, torch.Tensor | None]]:
    """The per-row arguments of :func:`token_log_probs_grad_` (``lse``, ``entropy``, ``grad_log_prob``,
    ``grad_entropy``), named for :func:`check_log_probs`."""
    return list(zip(("lse", "entropy", "grad_log_prob", "grad_entropy"), values))


def _token_log_probs_grad_fake(*args: object) -> None:
    return None  # the reference reads the targets


@declare(fake=_token_log_probs_grad_fake, mutates=("logits",))
def token_log_probs_grad_(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_log_prob: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    ignore_index: int,
    temperature: float,
) -> None:
    """Overwrite ``logits`` (a chunk, as :func:`token_log_probs` read it) with the gradient, with respect to them, of
    ``sum(grad_log_prob * log_prob + grad_entropy * entropy)`` over the rows (``lse``, ``entropy``: that call's; the
    gradients: fp32, one per row; ``grad_entropy`` None for 0), rounded once to their dtype: with ``s = logits /
    temperature`` and ``p = softmax(s)``, ``(grad_log_prob * (onehot(target) - p) - grad_entropy * p * (s - lse +
    entropy)) / temperature``, 0 on ignored rows. A chunk's backward never holds its logits and their gradient at
    once."""
    check_log_probs(
        "token_log_probs_grad_",
        logits,
        target,
        ignore_index,
        temperature,
        *grad_rows(lse, entropy, grad_log_prob, grad_entropy),
        host=logits.is_cpu,
    )
    rows = logits.float() / temperature
    ignored = target == ignore_index
    log_p = rows.sub_(lse.unsqueeze(1))
    p = log_p.exp()
    grad = p * -grad_log_prob.unsqueeze(1)
    grad.scatter_add_(1, target.masked_fill(ignored, 0).unsqueeze(1), grad_log_prob.unsqueeze(1))
    if grad_entropy is not None:
        grad.sub_(p.mul_(log_p.add_(entropy.unsqueeze(1))).mul_(grad_entropy.unsqueeze(1)))
    grad.masked_fill_(ignored.unsqueeze(1), 0.0)
    logits.copy_(grad.div_(temperature))
