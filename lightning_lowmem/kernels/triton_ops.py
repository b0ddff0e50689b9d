"""Triton kernels of the declared ops (:mod:`.torch_ops`): the GPU path without nvcc.

Triton ships with torch on Linux and compiles for the GPU at run time, so a pip-installed torch
runs these kernels where the CUDA C++ extension cannot be built. With ``TRITON_INTERPRET=1`` in
the environment when this module is first imported (Triton reads it when kernels are defined)
the same kernels run on CPU tensors in Triton's interpreter: that is how CI tests them. Each function here
takes its declaration's arguments and is registered as its operator by
:func:`~lightning_lowmem.kernels.library.triton_operators`, which gives fp64 calls and the ops without a Triton
kernel (a frozen norm's output, CPU-only) to the reference (training runs in fp32, bf16 and fp16).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from lightning_lowmem.kernels import torch_ops

ELEMENTS_PER_PROGRAM = 1024  # element-wise kernels: elements per program (4 warps)
MAX_NORM_BLOCK = 4096  # norms hold up to this many elements of a row at once and walk longer rows in chunks
MAX_CE_BLOCK = 4096  # the cross-entropy step likewise, over a row of logits
MIN_ROW_BLOCK = 128  # the smallest row chunk: one element per thread of 4 warps
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
COLUMN_TILE, COLUMN_SUM_ROWS, COLUMN_SUM_CHUNKS = 64, 64, 64  # a norm's column sums: columns a program, rows a chunk


@triton.jit
def _act_codes_kernel(x_ptr, thresholds_ptr, packed_ptr, numel, BITS: tl.constexpr, BYTES: tl.constexpr):
    # A [BYTES, 8 / BITS] tile of elements; each row's codes, shifted into disjoint bit fields, sum to one byte.
    PER_BYTE: tl.constexpr = 8 // BITS
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    slot = tl.arange(0, PER_BYTE)
    index = byte[:, None] * PER_BYTE + slot[None, :]
    inside = index < numel
    x = tl.load(x_ptr + index, mask=inside, other=0.0).to(tl.float32)
    code = tl.zeros([BYTES, PER_BYTE], dtype=tl.int32)
    for t in tl.static_range((1 << BITS) - 1):  # thresholds padded with +inf, which nothing exceeds
        code += (x > tl.load(thresholds_ptr + t)).to(tl.int32)
    code = tl.where(inside, code, 0)
    packed = tl.sum(code << (slot * BITS)[None, :], axis=1)
    tl.store(packed_ptr + byte, packed.to(tl.uint8), mask=byte * PER_BYTE < numel)


@triton.jit
def _act_backward_kernel(grad_ptr, packed_ptr, levels_ptr, out_ptr, numel, BITS: tl.constexpr, BYTES: tl.constexpr):
    PER_BYTE: tl.constexpr = 8 // BITS
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    slot = tl.arange(0, PER_BYTE)
    index = byte[:, None] * PER_BYTE + slot[None, :]
    inside = index < numel
    packed = tl.load(packed_ptr + byte, mask=byte * PER_BYTE < numel, other=0).to(tl.int32)
    code = (packed[:, None] >> (slot * BITS)[None, :]) & ((1 << BITS) - 1)
    level = tl.load(levels_ptr + code)  # a table of 2^BITS values: the gathers hit the cache
    grad = tl.load(grad_ptr + index, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + index, (grad * level).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _norm_forward_kernel(
    x_ptr, z_ptr, rstd_ptr, scale_ptr, shift_ptr, y_ptr, dim, eps,
    CENTER: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One row per program in chunks of BLOCK. LayerNorm merges each chunk's mean and centered sum of
    # squares into the row's (Chan et al.): fp32 statistics as accurate as two passes, the row read twice.
    # With a scale or a shift, y = scale * z + shift from z as stored, in the pass that writes z.
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * dim
    z_ptr += row * dim
    y_ptr += row * dim
    cols = tl.arange(0, BLOCK)
    mean = 0.0
    m2 = 0.0
    for start in range(0, dim, BLOCK):
        inside = start + cols < dim
        x = tl.load(x_ptr + start + cols, mask=inside, other=0.0).to(tl.float32)
        if CENTER:
            count = tl.minimum(dim - start, BLOCK).to(tl.float32)
            chunk_mean = tl.sum(x, axis=0) / count
            centered = tl.where(inside, x - chunk_mean, 0.0)
            delta = chunk_mean - mean
            total = start + count
            mean += delta * (count / total)
            m2 += tl.sum(centered * centered, axis=0) + delta * delta * (start * count / total)
        else:
            m2 += tl.sum(x * x, axis=0)
    rstd = tl.math.rsqrt(m2 / dim + eps)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, dim, BLOCK):
        inside = start + cols < dim
        x = tl.load(x_ptr + start + cols, mask=inside, other=0.0).to(tl.float32)
        z = ((x - mean) * rstd).to(z_ptr.dtype.element_ty)
        tl.store(z_ptr + start + cols, z, mask=inside)
        if HAS_SCALE or HAS_SHIFT:
            y = z.to(tl.float32)
            if HAS_SCALE:
                y = y * tl.load(scale_ptr + start + cols, mask=inside, other=0.0)
            if HAS_SHIFT:
                y = y + tl.load(shift_ptr + start + cols, mask=inside, other=0.0)
            tl.store(y_ptr + start + cols, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _norm_backward_kernel(
    grad_ptr,
    z_ptr,
    rstd_ptr,
    scale_ptr,
    out_ptr,
    dim,
    CENTER: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Paper, algorithms 2-3 on g = dL/dy * scale: dx = rstd * (g - mean(g) - z * mean(g*z)); RMSNorm drops mean(g).
    row = tl.program_id(0).to(tl.int64)
    grad_ptr += row * dim
    z_ptr += row * dim
    out_ptr += row * dim
    # The sums are reduced chunk by chunk: block-wide fp32 accumulators (summed once after the loop) crash
    # Triton 3.8's compiler for sm_90 at BLOCK 4096 (tests/triton_sm90_crash.py).
    cols = tl.arange(0, BLOCK)
    sum_g = 0.0
    sum_gz = 0.0
    for start in range(0, dim, BLOCK):
        inside = start + cols < dim
        g = tl.load(grad_ptr + start + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_SCALE:
            g *= tl.load(scale_ptr + start + cols, mask=inside, other=0.0)
        z = tl.load(z_ptr + start + cols, mask=inside, other=0.0).to(tl.float32)
        sum_g += tl.sum(g, axis=0)
        sum_gz += tl.sum(g * z, axis=0)
    mean_g = 0.0
    if CENTER:
        mean_g = sum_g / dim
    mean_gz = sum_gz / dim
    rstd = tl.load(rstd_ptr + row)
    for start in range(0, dim, BLOCK):
        inside = start + cols < dim
        g = tl.load(grad_ptr + start + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_SCALE:
            g *= tl.load(scale_ptr + start + cols, mask=inside, other=0.0)
        z = tl.load(z_ptr + start + cols, mask=inside, other=0.0).to(tl.float32)
        dx = rstd * ((g - mean_g) - z * mean_gz)
        tl.store(out_ptr + start + cols, dx.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _norm_column_sums_kernel(
    grad_ptr, z_ptr, partial_ptr, rows, dim, rows_per_chunk, ROWS: tl.constexpr, COLUMNS: tl.constexpr
):
    # sum(grad * z) and sum(grad) over a chunk of rows (program_id 1) for a tile of columns (program_id 0), fp32;
    # the caller sums the chunks: a norm's gamma and beta gradients in two launches, in a fixed order
    column = tl.program_id(0) * COLUMNS + tl.arange(0, COLUMNS)
    chunk = tl.program_id(1).to(tl.int64)
    first = chunk * rows_per_chunk
    last = tl.minimum(first + rows_per_chunk, rows)
    grad_z = tl.zeros((COLUMNS,), dtype=tl.float32)
    grad_sum = tl.zeros((COLUMNS,), dtype=tl.float32)
    for start in range(0, rows_per_chunk, ROWS):
        row = first + start + tl.arange(0, ROWS)
        inside = (row < last)[:, None] & (column < dim)[None, :]
        offsets = row[:, None] * dim + column[None, :]
        g = tl.load(grad_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        grad_z += tl.sum(g * z, axis=0)
        grad_sum += tl.sum(g, axis=0)
    tl.store(partial_ptr + chunk * 2 * dim + column, grad_z, mask=column < dim)
    tl.store(partial_ptr + (chunk * 2 + 1) * dim + column, grad_sum, mask=column < dim)


@triton.jit
def _sigmoid(x):
    e = tl.exp(-tl.abs(x))  # never overflows, unlike exp(-x)
    return tl.where(x >= 0, 1.0, e) / (1.0 + e)


@triton.jit
def _activation_and_slope(gate, KIND: tl.constexpr):
    # act(gate) and act'(gate) by the formulas of csrc/lowmem_math.h; tanh-GELU through
    # 0.5 * (1 + tanh(u)) = sigmoid(2u), the same function without a tanh (which Triton's interpreter lacks).
    if KIND == "silu":
        s = _sigmoid(gate)
        value = gate * s
        slope = s * (1.0 + gate * (1.0 - s))
    elif KIND == "gelu":
        cdf = 0.5 * (1.0 + tl.math.erf(gate * 0.7071067811865476))  # 1 / sqrt(2)
        value = gate * cdf
        slope = cdf + gate * tl.exp(-0.5 * gate * gate) * 0.3989422804014327  # 1 / sqrt(2 pi)
    else:
        k = 0.7978845608028654  # sqrt(2 / pi)
        s = _sigmoid(2.0 * k * (gate + 0.044715 * gate * gate * gate))
        value = gate * s
        slope = s + 2.0 * k * gate * s * (1.0 - s) * (1.0 + 3.0 * 0.044715 * gate * gate)
    return value, slope


@triton.jit
def _gated_backward_kernel(
    grad_ptr,
    gate_ptr,
    second_ptr,
    act_ptr,
    grad_gate_ptr,
    grad_up_ptr,
    numel,
    KIND: tl.constexpr,
    RECOVER_UP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < numel
    grad = tl.load(grad_ptr + index, mask=inside, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + index, mask=inside, other=0.0).to(tl.float32)
    second = tl.load(second_ptr + index, mask=inside, other=0.0).to(tl.float32)
    value, slope = _activation_and_slope(gate, KIND)
    if RECOVER_UP:  # second is h = act * up, act the forward's own bits: up = h / act (0 where act == 0)
        value = tl.load(act_ptr + index, mask=inside, other=0.0).to(tl.float32)
        up = tl.where(value != 0.0, tl.math.div_rn(second, tl.where(value != 0.0, value, 1.0)), 0.0)
    else:  # second is up; act rounded to the dtype, as the forward's product saw it
        value = value.to(grad_ptr.dtype.element_ty).to(tl.float32)
        up = second
    tl.store(grad_gate_ptr + index, (grad * up * slope).to(grad_gate_ptr.dtype.element_ty), mask=inside)
    tl.store(grad_up_ptr + index, (grad * value).to(grad_up_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _gated_exceptions_kernel(act_ptr, up_ptr, columns_ptr, up_at_ptr, cols, up_row_stride, slots, BLOCK: tl.constexpr):
    # One row per program, BLOCK columns a step: each zero's place among the row's zeros (a cumulative sum) is its
    # slot, the first `slots` kept; then the unused slots filled
    row = tl.program_id(0).to(tl.int64)
    found = 0
    for start in range(0, cols, BLOCK):
        column = start + tl.arange(0, BLOCK)
        inside = column < cols
        zero = (tl.load(act_ptr + row * cols + column, mask=inside, other=1.0) == 0.0) & inside
        place = found + tl.cumsum(zero.to(tl.int32), 0)  # 1-based among the row's zeros
        keep = zero & (place <= slots)
        up = tl.load(up_ptr + row * up_row_stride + column, mask=keep, other=0.0)
        tl.store(columns_ptr + row * slots + place - 1, column.to(tl.int32), mask=keep)
        tl.store(up_at_ptr + row * slots + place - 1, up, mask=keep)
        found += tl.sum(zero.to(tl.int32), 0)
    for start in range(0, slots, BLOCK):
        slot = start + tl.arange(0, BLOCK)
        unused = (slot >= found) & (slot < slots)
        tl.store(columns_ptr + row * slots + slot, tl.full((BLOCK,), -1, tl.int32), mask=unused)
        tl.store(up_at_ptr + row * slots + slot, tl.zeros((BLOCK,), up_at_ptr.dtype.element_ty), mask=unused)


@triton.jit
def _gated_exceptions_backward_kernel(
    grad_ptr,
    gate_ptr,
    columns_ptr,
    up_at_ptr,
    grad_gate_ptr,
    count,
    slots,
    cols,
    KIND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # The gate gradient at the forward's exceptions, which _gated_backward_kernel took up = 0 at
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    column = tl.load(columns_ptr + index, mask=index < count, other=-1)
    used = column >= 0
    element = index // slots * cols + column
    grad = tl.load(grad_ptr + element, mask=used, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + element, mask=used, other=0.0).to(tl.float32)
    up = tl.load(up_at_ptr + index, mask=used, other=0.0).to(tl.float32)
    _, slope = _activation_and_slope(gate, KIND)
    tl.store(grad_gate_ptr + element, (grad * up * slope).to(grad_gate_ptr.dtype.element_ty), mask=used)


@triton.jit
def _affine_weight_grad_kernel(
    product_ptr, total_ptr, scale_ptr, shift_ptr, out_ptr, numel, cols,
    HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # product * scale + total (x) shift, fp32: a linear's weight gradient from a norm's shared z
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < numel
    column = index % cols
    value = tl.load(product_ptr + index, mask=inside, other=0.0).to(tl.float32)
    if HAS_SCALE:
        value = value * tl.load(scale_ptr + column, mask=inside, other=0.0)
    if HAS_SHIFT:
        total = tl.load(total_ptr + index // cols, mask=inside, other=0.0).to(tl.float32)
        value = value + total * tl.load(shift_ptr + column, mask=inside, other=0.0)
    tl.store(out_ptr + index, value.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _keep_scaled(x_ptr, out_ptr, index, numel, word, threshold, scale):
    inside = index < numel
    x = tl.load(x_ptr + index, mask=inside, other=0.0).to(tl.float32)
    y = tl.where(word.to(tl.int64) >= threshold, x * scale, 0.0)
    tl.store(out_ptr + index, y.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _dropout_kernel(x_ptr, seed_ptr, out_ptr, numel, threshold, scale, BLOCK: tl.constexpr, FIRST: tl.constexpr):
    # BLOCK Philox counters, four elements each: element 4c + k keeps word k of counter first + c, first the seed's
    # second word where it has one (FIRST), else 0 (csrc/lowmem_math.h)
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    counter = index + tl.load(seed_ptr + 1) if FIRST else index
    zero = tl.zeros((BLOCK,), dtype=tl.uint32)
    w0, w1, w2, w3 = tl.philox(tl.load(seed_ptr), (counter & 0xFFFFFFFF).to(tl.uint32), (counter >> 32).to(tl.uint32),
                               zero, zero)  # fmt: skip
    _keep_scaled(x_ptr, out_ptr, 4 * index, numel, w0, threshold, scale)
    _keep_scaled(x_ptr, out_ptr, 4 * index + 1, numel, w1, threshold, scale)
    _keep_scaled(x_ptr, out_ptr, 4 * index + 2, numel, w2, threshold, scale)
    _keep_scaled(x_ptr, out_ptr, 4 * index + 3, numel, w3, threshold, scale)


@triton.jit
def _pair_at(x_ptr, scale_ptr, shift_ptr, grad_ptr, read_ptr, masked_ptr, i, numel, dim, word, threshold, kept_scale,
             HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr):  # fmt: skip
    inside = i < numel
    keep = word.to(tl.int64) >= threshold
    v = tl.load(x_ptr + i, mask=inside, other=0.0).to(tl.float32)
    if HAS_SCALE:
        v = v * tl.load(scale_ptr + i % dim, mask=inside, other=1.0)
    if HAS_SHIFT:
        v = v + tl.load(shift_ptr + i % dim, mask=inside, other=0.0)
    # the input the layer read: rounded to x's dtype (as the norm rounded its output), then to the layer's
    rebuilt = v.to(x_ptr.dtype.element_ty).to(tl.float32).to(read_ptr.dtype.element_ty).to(tl.float32)
    tl.store(read_ptr + i, tl.where(keep, rebuilt * kept_scale, 0.0).to(read_ptr.dtype.element_ty), mask=inside)
    g = tl.load(grad_ptr + i, mask=inside, other=0.0).to(tl.float32)
    tl.store(masked_ptr + i, tl.where(keep, g * kept_scale, 0.0).to(masked_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _dropout_pair_kernel(
    x_ptr, scale_ptr, shift_ptr, grad_ptr, seed_ptr, read_ptr, masked_ptr, numel, dim, threshold, kept_scale,
    HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # dropout_input_and_grad: BLOCK Philox counters as in _dropout_kernel, both outputs from their words
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    counter = index + tl.load(seed_ptr + 1) if FIRST else index
    zero = tl.zeros((BLOCK,), dtype=tl.uint32)
    w0, w1, w2, w3 = tl.philox(tl.load(seed_ptr), (counter & 0xFFFFFFFF).to(tl.uint32), (counter >> 32).to(tl.uint32),
                               zero, zero)  # fmt: skip
    _pair_at(x_ptr, scale_ptr, shift_ptr, grad_ptr, read_ptr, masked_ptr, 4 * index, numel, dim, w0, threshold,
             kept_scale, HAS_SCALE, HAS_SHIFT)  # fmt: skip
    _pair_at(x_ptr, scale_ptr, shift_ptr, grad_ptr, read_ptr, masked_ptr, 4 * index + 1, numel, dim, w1, threshold,
             kept_scale, HAS_SCALE, HAS_SHIFT)  # fmt: skip
    _pair_at(x_ptr, scale_ptr, shift_ptr, grad_ptr, read_ptr, masked_ptr, 4 * index + 2, numel, dim, w2, threshold,
             kept_scale, HAS_SCALE, HAS_SHIFT)  # fmt: skip
    _pair_at(x_ptr, scale_ptr, shift_ptr, grad_ptr, read_ptr, masked_ptr, 4 * index + 3, numel, dim, w3, threshold,
             kept_scale, HAS_SCALE, HAS_SHIFT)  # fmt: skip


@triton.jit
def _capped(row_ptr, cols, vocab, softcap, SOFTCAP: tl.constexpr):
    """A block of a row's logits, fp32, capped as Gemma 2 caps them (``softcap * tanh(x / softcap)``; -inf past
    the row's end), and the cap's derivative ``1 - tanh^2`` (1 without a cap), both from ``exp(-2|x| / softcap)``:
    no cancellation in the derivative where the cap saturates."""
    x = tl.load(row_ptr + cols, mask=cols < vocab, other=0.0).to(tl.float32)
    slope = tl.full(x.shape, 1.0, tl.float32)
    if SOFTCAP:
        e = tl.exp(-2.0 * tl.abs(x) / softcap)
        x = tl.where(x < 0, -softcap, softcap) * (1.0 - e) / (1.0 + e)
        slope = 4.0 * e / ((1.0 + e) * (1.0 + e))
    return tl.where(cols < vocab, x, float("-inf")), slope


@triton.jit
def _cross_entropy_grad_kernel(
    logits_ptr,
    target_ptr,
    loss_ptr,
    scale_ptr,
    vocab,
    ignore_index,
    smoothing,
    softcap,
    SOFTCAP: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One row per program, two passes: the online max and sum of exponentials (and the sum for label smoothing),
    # then the gradient (times the row's scale) written over the logits in their dtype, as csrc's
    # cross_entropy_rows does; the math is fp32 whatever the logits' dtype.
    row_ptr = logits_ptr + tl.program_id(0).to(tl.int64) * vocab
    target = tl.load(target_ptr + tl.program_id(0))
    cols = tl.arange(0, BLOCK)
    if target == ignore_index:
        for start in range(0, vocab, BLOCK):
            tl.store(
                row_ptr + start + cols, tl.zeros((BLOCK,), dtype=row_ptr.dtype.element_ty), mask=start + cols < vocab
            )
        tl.store(loss_ptr + tl.program_id(0), 0.0)
    else:
        peak = float("-inf")
        sum_exp = 0.0
        total = 0.0
        for start in range(0, vocab, BLOCK):
            x, _ = _capped(row_ptr, start + cols, vocab, softcap, SOFTCAP)
            new_peak = tl.maximum(peak, tl.max(x, 0))
            sum_exp = sum_exp * tl.exp(peak - new_peak) + tl.sum(tl.exp(x - new_peak), 0)
            peak = new_peak
            total += tl.sum(tl.where(start + cols < vocab, x, 0.0), 0)
        picked, _ = _capped(row_ptr + target, cols, 1, softcap, SOFTCAP)
        picked = tl.sum(tl.where(cols == 0, picked, 0.0), 0)
        loss = peak + tl.log(sum_exp) - (1.0 - smoothing) * picked - smoothing * total / vocab
        scale = tl.load(scale_ptr + tl.program_id(0)) if SCALED else 1.0
        for start in range(0, vocab, BLOCK):
            x, slope = _capped(row_ptr, start + cols, vocab, softcap, SOFTCAP)
            g = tl.exp(x - peak) / sum_exp - smoothing / vocab
            g = tl.where(start + cols == target, g - (1.0 - smoothing), g) * slope * scale
            tl.store(row_ptr + start + cols, g.to(row_ptr.dtype.element_ty), mask=start + cols < vocab)
        tl.store(loss_ptr + tl.program_id(0), loss)


@triton.jit
def _token_log_probs_kernel(
    logits_ptr, target_ptr, log_prob_ptr, entropy_ptr, lse_ptr, vocab, ignore_index, temperature, BLOCK: tl.constexpr
):
    # One row per program, one pass: the online max m, sum of exponentials and exponential-weighted sum of s - m (the
    # scaled logits s, shifted: no cancellation of large numbers); then lse = m + log(sum), the entropy log(sum) -
    # sum(p (s - m)) and the target's s - lse.
    row_ptr = logits_ptr + tl.program_id(0).to(tl.int64) * vocab
    target = tl.load(target_ptr + tl.program_id(0))
    cols = tl.arange(0, BLOCK)
    peak = float("-inf")
    sum_exp = 0.0
    weighted = 0.0
    for start in range(0, vocab, BLOCK):
        inside = start + cols < vocab
        x = tl.load(row_ptr + start + cols, mask=inside, other=0.0).to(tl.float32) / temperature
        x = tl.where(inside, x, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(x, 0))
        shrink = tl.exp(peak - new_peak)
        moved = tl.where(sum_exp > 0, (weighted + (peak - new_peak) * sum_exp) * shrink, 0.0)  # to the new max
        e = tl.exp(x - new_peak)
        sum_exp = sum_exp * shrink + tl.sum(e, 0)
        weighted = moved + tl.sum(tl.where(inside, e * (x - new_peak), 0.0), 0)
        peak = new_peak
    lse = peak + tl.log(sum_exp)
    tl.store(lse_ptr + tl.program_id(0), lse)
    if target == ignore_index:
        tl.store(log_prob_ptr + tl.program_id(0), 0.0)
        tl.store(entropy_ptr + tl.program_id(0), 0.0)
    else:
        picked = tl.load(row_ptr + target).to(tl.float32) / temperature
        tl.store(log_prob_ptr + tl.program_id(0), picked - lse)
        tl.store(entropy_ptr + tl.program_id(0), tl.log(sum_exp) - weighted / sum_exp)


@triton.jit
def _token_log_probs_grad_kernel(
    logits_ptr, target_ptr, lse_ptr, entropy_ptr, grad_log_prob_ptr, grad_entropy_ptr, vocab, ignore_index,
    temperature, HAS_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One row per program, one pass: (g_lp (onehot - p) - g_H p (log p + H)) / T over the logits, in their dtype.
    row_ptr = logits_ptr + tl.program_id(0).to(tl.int64) * vocab
    target = tl.load(target_ptr + tl.program_id(0))
    cols = tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + tl.program_id(0))
    entropy = tl.load(entropy_ptr + tl.program_id(0))
    grad_log_prob = tl.load(grad_log_prob_ptr + tl.program_id(0))
    grad_entropy = tl.load(grad_entropy_ptr + tl.program_id(0)) if HAS_ENTROPY else 0.0
    for start in range(0, vocab, BLOCK):
        inside = start + cols < vocab
        log_p = tl.load(row_ptr + start + cols, mask=inside, other=0.0).to(tl.float32) / temperature - lse
        p = tl.exp(log_p)
        g = -grad_log_prob * p
        g = tl.where(start + cols == target, g + grad_log_prob, g)
        if HAS_ENTROPY:
            g -= grad_entropy * p * (log_p + entropy)
        g = tl.where(target == ignore_index, 0.0, g / temperature)
        tl.store(row_ptr + start + cols, g.to(row_ptr.dtype.element_ty), mask=inside)


# Decided when the kernels above were defined: True when they run in Triton's interpreter.
INTERPRETED = not isinstance(_act_codes_kernel, triton.runtime.JITFunction)


@contextlib.contextmanager
def _launching_on(op: str, x: torch.Tensor) -> Iterator[None]:
    """Launch on ``x``'s GPU (Triton launches on the current device); CPU tensors only when interpreted."""
    if x.is_cuda:
        with torch.cuda.device(x.device):
            yield
    elif x.device.type == "cpu" and INTERPRETED:
        yield
    else:
        raise RuntimeError(
            f"{op}: the Triton kernels run on CUDA tensors, and on CPU tensors only in Triton's interpreter "
            f"(TRITON_INTERPRET=1 set before lightning_lowmem first uses Triton); got a tensor on {x.device}"
        )


def _check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in _DTYPES:
        raise TypeError(f"{op}: unsupported dtype {t.dtype} for {name}; supported: float16, bfloat16, float32, float64")


@functools.cache
def _table(values: tuple[float, ...], size: int, pad: float, device: torch.device) -> torch.Tensor:
    """``values`` padded with ``pad`` to ``size`` fp32 entries, on ``device`` (made once per table)."""
    return torch.tensor(values + (pad,) * (size - len(values)), dtype=torch.float32, device=device)


def act_codes(x: torch.Tensor, thresholds: tuple[float, ...]) -> torch.Tensor:
    _check_float("act_codes", "x", x)
    bits = torch_ops.storage_bits(len(thresholds))
    if list(thresholds) != sorted(thresholds):
        raise ValueError("act_codes: thresholds must be ascending")
    packed = torch.empty(torch_ops.packed_bytes(x.numel(), bits), dtype=torch.uint8, device=x.device)
    if x.numel() == 0:
        return packed
    per_program = ELEMENTS_PER_PROGRAM * bits // 8
    table = _table(tuple(thresholds), (1 << bits) - 1, math.inf, x.device)
    with _launching_on("act_codes", x):
        _act_codes_kernel[(triton.cdiv(packed.numel(), per_program),)](
            x.contiguous(), table, packed, x.numel(), BITS=bits, BYTES=per_program, num_warps=8
        )  # 8 warps: at 4, ptxas spills 16 bytes on sm_90 for fp16 at 2 bits (python -m ...kernels.triton_aot)
    return packed


def act_forward(x: torch.Tensor, kind: str, thresholds: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The stock activation (ATen's CUDA kernel), then the codes kernel."""
    return torch_ops.stock_activation(x, kind).contiguous(), act_codes(x, thresholds)


def act_backward(grad: torch.Tensor, packed: torch.Tensor, levels: tuple[float, ...]) -> torch.Tensor:
    _check_float("act_backward", "grad", grad)
    if packed.dtype != torch.uint8:
        raise TypeError(f"act_backward: packed codes must be uint8, got {packed.dtype}")
    bits = torch_ops.level_bits(len(levels))
    if packed.numel() != torch_ops.packed_bytes(grad.numel(), bits):
        raise ValueError(f"act_backward: {packed.numel()} packed bytes do not hold {grad.numel()} codes of {bits} bits")
    grad = grad.contiguous()
    out = torch.empty_like(grad)
    if grad.numel() == 0:
        return out
    per_program = ELEMENTS_PER_PROGRAM * bits // 8
    table = _table(tuple(levels), 1 << bits, levels[-1], grad.device)
    with _launching_on("act_backward", grad):
        _act_backward_kernel[(triton.cdiv(packed.numel(), per_program),)](
            grad, packed.contiguous(), table, out, grad.numel(), BITS=bits, BYTES=per_program
        )
    return out


def _rows(op: str, t: torch.Tensor, dim: int) -> int:
    if dim <= 0 or t.numel() % dim:
        raise ValueError(f"{op}: cannot normalize {t.numel()} elements over trailing size {dim}")
    return t.numel() // dim


def norm_settings(dim: int) -> tuple[int, int]:
    """Chunk length for rows of ``dim`` elements, a power of two from :data:`MIN_ROW_BLOCK` (an element per thread
    of 4 warps) to :data:`MAX_NORM_BLOCK`, and warps: at most 8 elements per thread from 2048 on (at 16 per
    thread the backward needs 128-146 registers and spills on sm_120)."""
    block = min(max(triton.next_power_of_2(dim), MIN_ROW_BLOCK), MAX_NORM_BLOCK)
    return block, max(4, block // 256)


def cross_entropy_settings(vocab: int, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """Logits per chunk of a row (a power of two from :data:`MIN_ROW_BLOCK` to :data:`MAX_CE_BLOCK`, half that for
    16-bit logits) and warps: at most 4 logits per thread from 1024 on (with fewer warps ptxas spills on sm_90 with a
    softcap; with 16-bit logits at 4096, on sm_100)."""
    largest = MAX_CE_BLOCK if dtype == torch.float32 else MAX_CE_BLOCK // 2
    block = min(max(triton.next_power_of_2(vocab), MIN_ROW_BLOCK), largest)
    return block, max(4, block // 128)


def norm_forward(
    x: torch.Tensor, dim: int, eps: float, center: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    _, z, rstd = _norm_forward(x, dim, eps, center, out_dtype, None, None)
    return z, rstd


def norm_affine_forward(
    x: torch.Tensor,
    dim: int,
    eps: float,
    center: bool,
    out_dtype: torch.dtype,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch_ops.check_affine("norm_affine_forward", dim, x.dtype, scale, shift)
    return _norm_forward(x, dim, eps, center, out_dtype, scale, shift)


def _norm_forward(
    x: torch.Tensor,
    dim: int,
    eps: float,
    center: bool,
    out_dtype: torch.dtype,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(y, z, rstd)``, ``y`` None without a scale or a shift: one launch."""
    _check_float("norm_forward", "x", x)
    if not eps > 0:
        raise ValueError(f"norm_forward: eps must be positive, got {eps}")
    rows = _rows("norm_forward", x, dim)
    z = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    y = None if scale is None and shift is None else torch.empty_like(z)
    if rows == 0:
        return y, z, rstd
    block, warps = norm_settings(dim)
    with _launching_on("norm_forward", x):
        _norm_forward_kernel[(rows,)](
            x.contiguous(), z, rstd, rstd if scale is None else scale.contiguous(),
            rstd if shift is None else shift.contiguous(), z if y is None else y, dim, eps,
            CENTER=center, HAS_SCALE=scale is not None, HAS_SHIFT=shift is not None, BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return y, z, rstd


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
    """The column sums (gamma / beta gradients): partial sums per chunk of rows, then a torch sum over the chunks."""
    _check_float("norm_backward", "grad", grad)
    _check_float("norm_backward", "z", z)
    if grad.shape != z.shape:
        raise ValueError(f"norm_backward: grad shape {tuple(grad.shape)} differs from output shape {tuple(z.shape)}")
    rows = _rows("norm_backward", z, dim)
    if rstd.numel() != rows or rstd.dtype != torch.float32:
        raise ValueError(
            f"norm_backward: expected {rows} rstd values of dtype float32, got {rstd.numel()} of {rstd.dtype}"
        )
    if scale is not None and (scale.numel() != dim or scale.dtype != torch.float32):
        raise ValueError(
            f"norm_backward: expected {dim} scale values of dtype float32, got {scale.numel()} of {scale.dtype}"
        )
    grad, z = grad.to(z.dtype).contiguous(), z.contiguous()
    grad_input = torch.empty(z.shape, dtype=dtype, device=z.device)
    sums = rstd.new_empty(0)
    if rows == 0:
        return grad_input, rstd.new_zeros(2, dim) if column_sums else sums
    block, warps = norm_settings(dim)
    with _launching_on("norm_backward", z):
        _norm_backward_kernel[(rows,)](
            grad, z, rstd.contiguous(), rstd if scale is None else scale.contiguous(), grad_input, dim,
            CENTER=center, HAS_SCALE=scale is not None, BLOCK=block, num_warps=warps,
        )  # fmt: skip
        if column_sums:
            chunks = min(COLUMN_SUM_CHUNKS, triton.cdiv(rows, COLUMN_SUM_ROWS))
            rows_per_chunk = triton.cdiv(rows, chunks)
            partial = rstd.new_empty(chunks, 2, dim)
            _norm_column_sums_kernel[(triton.cdiv(dim, COLUMN_TILE), chunks)](
                grad, z, partial, rows, dim, rows_per_chunk, ROWS=COLUMN_SUM_ROWS // 4, COLUMNS=COLUMN_TILE
            )
            sums = partial.sum(0)
    return grad_input, sums


def gated_exceptions(act: torch.Tensor, up: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch_ops.check_gated_exceptions(act, up, slots)
    _check_float("gated_exceptions", "act", act)
    rows, cols = torch_ops.rows_and_columns(act)
    columns = torch.empty((rows, slots), dtype=torch.int32, device=act.device)
    up_at = up.new_empty((rows, slots))
    if rows == 0 or slots == 0:
        return columns, up_at
    if cols == 0:
        return columns.fill_(-1), up_at.zero_()
    rows_of_up = up.reshape(rows, cols)  # a view where it can be (a packed half: row stride 2 x cols)
    if rows_of_up.stride(1) != 1:
        rows_of_up = rows_of_up.contiguous()
    with _launching_on("gated_exceptions", act):
        _gated_exceptions_kernel[(rows,)](
            act.contiguous(), rows_of_up, columns, up_at, cols, rows_of_up.stride(0), slots,
            BLOCK=min(MAX_NORM_BLOCK, max(MIN_ROW_BLOCK, triton.next_power_of_2(cols))),
        )  # fmt: skip
    return columns, up_at


def gated_backward(
    grad: torch.Tensor,
    gate: torch.Tensor,
    second: torch.Tensor,
    kind: str,
    act: torch.Tensor | None,
    columns: torch.Tensor | None = None,
    up_at: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    torch_ops.check_gated(grad, gate, second, kind, act, columns, up_at)
    _check_float("gated_backward", "grad", grad)
    grad, gate = grad.contiguous(), gate.contiguous()
    grad_gate, grad_up = torch.empty_like(grad), torch.empty_like(grad)
    if grad.numel() == 0:
        return grad_gate, grad_up
    with _launching_on("gated_backward", grad):
        _gated_backward_kernel[(triton.cdiv(grad.numel(), ELEMENTS_PER_PROGRAM),)](
            grad, gate, second.contiguous(), None if act is None else act.contiguous(),
            grad_gate, grad_up, grad.numel(), KIND=kind, RECOVER_UP=act is not None, BLOCK=ELEMENTS_PER_PROGRAM,
        )  # fmt: skip
        if columns is not None and columns.numel():
            _gated_exceptions_backward_kernel[(triton.cdiv(columns.numel(), ELEMENTS_PER_PROGRAM),)](
                grad, gate, columns.contiguous(), up_at.contiguous(), grad_gate, columns.numel(), columns.shape[1],
                torch_ops.rows_and_columns(grad)[1], KIND=kind, BLOCK=ELEMENTS_PER_PROGRAM,
            )  # fmt: skip
    return grad_gate, grad_up


def dropout(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    torch_ops.check_dropout(x, p, seed)
    _check_float("dropout", "x", x)
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    counters = (x.numel() + 3) // 4
    with _launching_on("dropout", x):
        _dropout_kernel[(triton.cdiv(counters, ELEMENTS_PER_PROGRAM // 4),)](
            x,
            seed,
            out,
            x.numel(),
            torch_ops.dropout_threshold(p),
            1.0 / (1.0 - p),
            BLOCK=ELEMENTS_PER_PROGRAM // 4,
            FIRST=seed.numel() > 1,
        )
    return out


def dropout_input_and_grad(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    dtype: torch.dtype,
    grad: torch.Tensor,
    p: float,
    seed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    torch_ops.check_dropout(grad, p, seed)
    _check_float("dropout_input_and_grad", "x", x)
    _check_float("dropout_input_and_grad", "grad", grad)
    if x.dim() == 0 or x.shape != grad.shape or grad.dtype != dtype:
        raise ValueError(
            f"dropout_input_and_grad: grad must be {dtype} of x's shape {tuple(x.shape)}, got {grad.dtype} "
            f"{tuple(grad.shape)}"
        )
    for name, values in (("scale", scale), ("shift", shift)):
        if values is not None and (values.numel() != x.shape[-1] or values.dtype != torch.float32):
            raise ValueError(
                f"dropout_input_and_grad: expected {x.shape[-1]} {name} values of dtype float32, got {values.numel()} "
                f"of {values.dtype}"
            )
    x, grad = x.contiguous(), grad.contiguous()
    read, masked = torch.empty(x.shape, dtype=dtype, device=x.device), torch.empty_like(grad)
    if x.numel() == 0:
        return read, masked
    counters = (x.numel() + 3) // 4
    with _launching_on("dropout_input_and_grad", x):
        _dropout_pair_kernel[(triton.cdiv(counters, ELEMENTS_PER_PROGRAM // 4),)](
            x, grad if scale is None else scale.contiguous(), grad if shift is None else shift.contiguous(), grad, seed,
            read, masked,
            x.numel(), x.shape[-1], torch_ops.dropout_threshold(p), 1.0 / (1.0 - p), HAS_SCALE=scale is not None,
            HAS_SHIFT=shift is not None, FIRST=seed.numel() > 1, BLOCK=ELEMENTS_PER_PROGRAM // 4,
        )  # fmt: skip
    return read, masked


def affine_weight_grad(
    product: torch.Tensor,
    total: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    torch_ops.check_affine_weight_grad(product, total, scale, shift, dtype)
    _check_float("affine_weight_grad", "product", product)
    product = product.contiguous()
    out = torch.empty(product.shape, dtype=dtype, device=product.device)
    if product.numel() == 0:
        return out
    with _launching_on("affine_weight_grad", product):
        _affine_weight_grad_kernel[(triton.cdiv(product.numel(), ELEMENTS_PER_PROGRAM),)](
            product, product if total is None else total.contiguous(), product if scale is None else scale.contiguous(),
            product if shift is None else shift.contiguous(), out, product.numel(), product.shape[1],
            HAS_SCALE=scale is not None, HAS_SHIFT=shift is not None, BLOCK=ELEMENTS_PER_PROGRAM,
        )  # fmt: skip
    return out


def cross_entropy_grad_(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    torch_ops.check_cross_entropy(logits, target, ignore_index, label_smoothing, softcap, row_scale, host=False)
    loss = torch.empty(len(target), dtype=torch.float32, device=logits.device)
    if logits.numel() == 0:
        return loss.zero_()
    block, warps = cross_entropy_settings(logits.shape[1], logits.dtype)
    with _launching_on("cross_entropy_grad_", logits):
        _cross_entropy_grad_kernel[(len(target),)](
            logits, target.contiguous(), loss, loss if row_scale is None else row_scale.contiguous(), logits.shape[1],
            ignore_index, label_smoothing, softcap, SOFTCAP=softcap > 0, SCALED=row_scale is not None, BLOCK=block,
            num_warps=warps,
        )  # fmt: skip
    return loss


def token_log_probs(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch_ops.check_log_probs("token_log_probs", logits, target, ignore_index, temperature, host=False)
    log_prob, entropy, lse = (torch.empty(len(target), dtype=torch.float32, device=logits.device) for _ in range(3))
    if logits.numel() == 0:
        return log_prob.zero_(), entropy.zero_(), lse.fill_(float("-inf"))
    block, warps = cross_entropy_settings(logits.shape[1], logits.dtype)
    with _launching_on("token_log_probs", logits):
        _token_log_probs_kernel[(len(target),)](
            logits, target.contiguous(), log_prob, entropy, lse, logits.shape[1], ignore_index, temperature,
            BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return log_prob, entropy, lse


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
    per_row = torch_ops.grad_rows(lse, entropy, grad_log_prob, grad_entropy)
    torch_ops.check_log_probs("token_log_probs_grad_", logits, target, ignore_index, temperature, *per_row, host=False)
    if logits.numel() == 0:
        return
    block, warps = cross_entropy_settings(logits.shape[1], logits.dtype)
    with _launching_on("token_log_probs_grad_", logits):
        _token_log_probs_grad_kernel[(len(target),)](
            logits, target.contiguous(), lse, entropy, grad_log_prob,
            grad_log_prob if grad_entropy is None else grad_entropy, logits.shape[1], ignore_index, temperature,
            HAS_ENTROPY=grad_entropy is not None, BLOCK=block, num_warps=warps,
        )  # fmt: skip
