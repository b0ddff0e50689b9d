"""The product ``h = act(gate) * up`` of gated MLPs (SwiGLU, GeGLU) as one low-memory op.

Stock autograd saves ``gate`` for the activation and ``act(gate)`` and ``up`` for the product:
three activations per intermediate element, four with the ``h`` a trainable down projection
saves. This op saves two, or effectively one:

- ``mode="gate_up"`` saves ``gate`` and ``up`` and recomputes ``act`` and ``act'`` in backward
  (what Liger Kernel's fused SwiGLU saves). Exact.
- ``mode="gate"`` saves ``gate`` and its own output ``h``, and recovers ``up = h / act(gate)`` in
  backward, with ``act(gate)`` recomputed by the very op (and on the very memory layout) the
  forward used, so it divides by the bits the forward multiplied with. When the down projection
  saves ``h`` anyway (trainable, or LoRA on it), that is the same storage, so ``gate`` is the only
  extra activation. Exact up to the rounding of ``h`` to its dtype. Where ``act(gate) == 0``
  exactly (``gate == 0``: in bf16 a LoRA term can cancel the base's, 1 element in 1,000-10,000), ``h``
  holds nothing of ``up``: the forward keeps ``up`` there, for up to one element in :data:`EXCEPTIONS_PER` of each
  row (the kernels' ``gated_exceptions``: a fixed size, one pass, no host synchronisation; an int32 column and ``up``
  in its dtype a slot, 6 bytes in bf16: 0.012 bytes per element at LLaMA's widths), and the backward kernel takes
  it from there. Past that many in a row (not seen in practice) the rest take ``up = 0``, as a gradient of 0
  there; ``gated="exact"`` (``mode="gate_up"``) saves ``up`` whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_lowmem import kernels
from lightning_lowmem.ops._checks import check_float_tensor, needs_graph, refuse_double_backward
from lightning_lowmem.registry.activations import get_activation

MODES = ("gate_up", "gate")
EXCEPTIONS_PER = 512
"""``mode="gate"`` keeps ``up`` exactly at up to one element in this many where ``act(gate)`` is 0."""


def slots_per_row(columns: int) -> int:
    """How many of a row's elements ``mode="gate"`` can keep ``up`` at: one in :data:`EXCEPTIONS_PER`, rounded up,
    so that what it keeps grows linearly with the tokens (the memory model extrapolates it)."""
    return -(-columns // EXCEPTIONS_PER)


def exception_slots(shape: Sequence[int]) -> int:
    """How many elements of a product of ``shape`` ``mode="gate"`` can keep ``up`` at (:func:`slots_per_row` for
    each row of its last dimension)."""
    columns = shape[-1] if shape else 1
    return math.prod(shape[:-1]) * slots_per_row(columns)


def exception_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """What ``mode="gate"`` keeps for its exceptions: per slot an int32 column and ``up`` in ``dtype``."""
    return exception_slots(shape) * (4 + dtype.itemsize)


class GatedActivationFunction(torch.autograd.Function):
    """Stock forward (``act`` then ``*``); backward from (gate, up) or (gate, output) and the exceptions.
    ``lowmem::gated_activation`` is this function in C++ (the eager path of the compiled backends)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, kind: str, recover_up: bool, slots: int) -> torch.Tensor:
        act = kernels.torch_ops.stock_activation(gate, kind)
        h = act * up  # on the inputs as given: stock bits
        # a contiguous copy of a strided half (timm's packed fc1), not a view that keeps both halves alive;
        # an expanded gate is kept as it is (it holds fewer elements than a copy)
        saved_gate = gate if 0 in gate.stride() else gate.contiguous()
        if recover_up:
            ctx.save_for_backward(saved_gate, h, *kernels.implementation(act.device).gated_exceptions(act, up, slots))
        else:
            ctx.save_for_backward(saved_gate, up.contiguous())
        ctx.kind, ctx.recover_up = kind, recover_up
        ctx.layout = None if saved_gate is gate else (gate.size(), gate.stride())
        return h

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_double_backward("gated_activation")
        gate, second, *exceptions = ctx.saved_tensors
        act = forward_activation(gate, ctx.layout, ctx.kind) if ctx.recover_up else None
        grad = grad.to(gate.dtype).contiguous()
        grad_gate, grad_up = kernels.implementation(grad.device).gated_backward(
            grad, gate, second, ctx.kind, act, *exceptions
        )
        needs_gate, needs_up = ctx.needs_input_grad[:2]
        return grad_gate if needs_gate else None, grad_up if needs_up else None, None, None, None


def forward_activation(
    gate: torch.Tensor, layout: tuple[torch.Size, tuple[int, ...]] | None, kind: str
) -> torch.Tensor:
    """``act(gate)`` with the very bits the forward multiplied by: the stock op again, on the forward's
    memory layout ``(size, stride)`` (None: ``gate``'s own), since ATen's CPU kernels round a strided
    input differently from a contiguous one. Recovering ``up = h / act`` needs these exact bits."""
    if layout is not None:
        gate = torch.empty_strided(*layout, dtype=gate.dtype, device=gate.device).copy_(gate)
    return kernels.library.OPS.stock_activation(gate, kind)  # opaque: torch.compile keeps it in backward


def gated_activation(
    gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", mode: str = "gate_up"
) -> torch.Tensor:
    """``act(gate) * up`` (``activation``: a registry activation with a gated kernel, ``"silu"``, ``"gelu"`` or
    ``"gelu_tanh"``), saving less.

    ``mode="gate_up"`` saves ``gate`` and ``up``; ``mode="gate"`` saves ``gate`` and the output,
    which costs one activation less when the next layer saves the output too (see the module
    docstring). The forward is bit-identical to ``act(gate) * up``; ``gate`` and ``up`` must have
    the same shape (no broadcasting); different dtypes are promoted as ``*`` would.
    """
    check_float_tensor("gated_activation", gate)
    check_float_tensor("gated_activation", up)
    kind = get_activation(activation, "gated_activation", gated=True).kernel
    if mode not in MODES:
        raise ValueError(f"gated_activation: mode must be one of {MODES}, got {mode!r}")
    if gate.shape != up.shape:
        raise ValueError(
            f"gated_activation: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape"
        )
    dtype = gate.dtype if gate.dtype == up.dtype else torch.promote_types(gate.dtype, up.dtype)  # no op when alike
    gate, up = gate.to(dtype), up.to(dtype)
    if not (needs_graph(gate) or needs_graph(up)):
        return kernels.torch_ops.stock_activation(gate, kind) * up
    slots = slots_per_row(gate.shape[-1] if gate.dim() else 1)  # where act is 0, up kept for this many a row
    if kernels.autograd_in_cpp(gate):
        return kernels.library.OPS.gated_activation.default(gate, up, kind, mode == "gate", slots)
    return GatedActivationFunction.apply(gate, up, kind, mode == "gate", slots)
