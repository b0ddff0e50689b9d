"""The kernel contract: what every backend implements, with the same names, arguments and meaning.

Four backends implement it: the pure-PyTorch reference (:mod:`.torch_ops`), the C++ CPU and CUDA
extensions (``csrc/``, run as the ``torch.ops.lowmem`` operators of :mod:`.library`, whose schemas
mirror these signatures) and the Triton kernels (:mod:`.triton_ops`). The autograd functions of
:mod:`lightning_lowmem.ops` call :func:`~lightning_lowmem.kernels.implementation` and never know which one
runs; ``tests/test_kernel_contract.py`` checks every backend against this class, op by op.

Codes: with ``n = len(thresholds)`` (ascending) a code takes ``k = storage_bits(n)`` bits: 1 for one
threshold, 2 for two or three, 4 for four to fifteen (3-bit tables pack as 4); ``8/k`` codes per byte,
element ``i`` in bits ``k*(i % (8/k))`` of byte ``i // (8/k)``. Activation ``kind``: a kernel id of the
activation registry (``"silu"``, ``"gelu"``, ``"gelu_tanh"``). fp64 inputs compute in fp64, every other
dtype in fp32 (the accumulate dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class KernelContract(Protocol):
    """The functions of a kernel backend (a module, or the operators' namespace)."""

    def act_codes(self, x: torch.Tensor, thresholds: Sequence[float]) -> torch.Tensor:
        """The uint8 buffer of ``ceil(numel*k/8)`` bytes holding ``code = sum(x > t_i)`` for every element in
        row-major order, thresholds compared in the accumulate dtype. The activation itself is no kernel's
        business: the op computes it with the stock PyTorch function, so any activation works with the codes."""

    def act_forward(self, x: torch.Tensor, kind: str, thresholds: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y, packed)`` for a contiguous ``x``: ``y`` is the stock activation ``kind`` bit for bit and
        ``packed`` is ``act_codes(x, thresholds)``; a backend may compute both in one pass."""

    def act_backward(self, grad: torch.Tensor, packed: torch.Tensor, levels: Sequence[float]) -> torch.Tensor:
        """``grad * levels[code]`` in the accumulate dtype, returned in ``grad``'s dtype and shape;
        ``len(levels)`` is ``len(thresholds) + 1``, which fixes the storage bits."""

    def norm_forward(
        self, x: torch.Tensor, dim: int, eps: float, center: bool, out_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z, rstd)`` of a contiguous ``x`` normalized over its trailing ``dim`` elements: ``z`` (shape of
        ``x``, ``out_dtype``) the affine-free output, ``rstd`` (one per row, accumulate dtype) the reciprocal
        standard deviation. ``center``: LayerNorm (True) or RMSNorm (False)."""

    def norm_affine_forward(
        self,
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

    def norm_backward(
        self,
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

    def norm_exact_columns(self, scale: torch.Tensor | None, shift: torch.Tensor | None) -> torch.Tensor:
        """The columns where ``z = (y - shift) / scale`` loses precision (ascending int64 indices; how many
        depends on the values): ``scale`` 0, or ``|shift| > |scale|`` (a missing scale is 1)."""

    def norm_output_forward(
        self,
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
        indices, each once: the affine's ``norm_exact_columns``)."""

    def norm_output_backward(
        self,
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
        except at ``columns`` (ascending int64 indices, each once), whose ``z`` is ``exact``."""

    def gated_exceptions(self, act: torch.Tensor, up: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(columns, up_at)`` where ``act == 0`` (``act`` the forward's ``act(gate)``, ``up`` its other factor: one
        shape and dtype): there ``h = act * up`` holds nothing of ``up``. Per row (the last dimension), the first
        ``slots`` such columns in ascending order (int32, ``-1`` in the slots past the row's last) and ``up`` at them
        (``up``'s dtype, 0 past the last), each of shape ``(rows, slots)``. A fixed size: nothing read back to the
        host; one pass over ``act`` (``up`` is read at the columns only)."""

    def gated_backward(
        self,
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

    def dropout(self, x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
        """``x * keep / (1 - p)`` (``0 <= p < 1``) in the accumulate dtype, returned contiguous in ``x``'s dtype:
        element ``i`` (row-major) is kept when word ``i % 4`` of the Philox4x32-10 block of counter ``first + i // 4``
        under key ``key`` is at least ``round(p * 2^32)`` (``csrc/lowmem_math.h``: ATen's and Triton's Philox, so
        every backend draws the same mask). ``seed``: int64 ``[key]`` (``first`` 0) or ``[key, first]`` on ``x``'s
        device (the C++ autograd draws a GPU's key and counters from its generator, as ATen's dropout does). A
        backward applies the forward's mask by calling it on the gradient with the same seed: nothing but the seed
        is saved."""

    def dropout_input_and_grad(
        self,
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
        :func:`~lightning_lowmem.kernels.torch_ops.affine`) rounded to ``dtype``, or ``x`` in ``dtype`` with neither;
        ``grad`` (``dtype``, ``x``'s shape) is the gradient of what the layer read. What the affine and two ``dropout``
        calls give, with a fused multiply-add where a backend fuses it; one launch where they took three to five."""

    def affine_weight_grad(
        self,
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

    def cross_entropy_grad_(
        self,
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
