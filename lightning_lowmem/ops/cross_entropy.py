"""A linear head and its cross-entropy in one op that never holds the logits: chunks of rows, one at a time.

Stock ``F.cross_entropy(F.linear(hidden, weight).float(), target)`` keeps ``rows x vocabulary`` fp32 values for
backward (and holds the logits' gradient at the start of the backward): with a 128k-152k vocabulary the largest
activation of a fine-tune. Here each chunk's logits are computed, turned into the loss and, in place, into the
loss's gradient with respect to them (the backend's ``cross_entropy_grad_``: fp32 log-sum-exp, label smoothing,
Gemma 2's ``softcap``), and at once into the gradients of the hidden states (a chunk of rows) and of the weight
and bias (accumulated in fp32): the three matmuls stock runs, no recompute. Only ``hidden``'s gradient (and the
weight's, when it trains) crosses to the backward, which scales it by the upstream gradient.

That scaling is exact for ``reduction="mean"`` and ``"sum"`` (one number) and, row by row, for ``"none"``'s
hidden-state gradient; the weight gradient under ``"none"`` needs the upstream gradient before it sums over
rows, so there the backward recomputes each chunk (one matmul more) from the saved hidden states. Measured: at
LLaMA-2's head (4096 x 32,000) the matmuls are nearly all of the time, so recomputing them would cost about a
third more than stock; computed in the forward it costs no more (``benchmarks/cross_entropy.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_lowmem import kernels
from lightning_lowmem.ops._checks import check_float_tensor, refuse_double_backward
from lightning_lowmem.ops.autocast import autocast_dtype

REDUCTIONS = ("mean", "sum", "none")
CHUNK_BYTES = 128 << 20
"""fp32 logits per chunk: enough rows that the chunk's matmuls run as fast as whole ones (each chunk reads the
whole weight; at 32 rows of a 64k vocabulary the head took 1.2-1.7x stock's time on CPU, at 128 MiB 0.6-1.0x),
a small share of stock's logits and their gradient at long sequences."""


def chunk_rows(vocab: int) -> int:
    """Rows per chunk: :data:`CHUNK_BYTES` of fp32 logits, at least 8."""
    return max(8, CHUNK_BYTES // (4 * max(vocab, 1)))


class _Chunks:
    """The head's operands in its compute dtype (autocast's, else the promoted one, as ``F.linear`` would run),
    cast once, and what each chunk of rows needs: its fp32 logits (in one reused buffer), then from their
    gradient the hidden states' gradient rows and the weight and bias gradients, accumulated in place (the
    weight's in the compute dtype: no weight-sized temporary per chunk, no fp32 copy of the weight)."""

    def __init__(self, hidden, weight, bias, needs: tuple[bool, bool, bool]) -> None:
        dtype = autocast_dtype(hidden) or torch.promote_types(hidden.dtype, weight.dtype)
        self.hidden, self.weight = hidden.to(dtype), weight.to(dtype)
        self.bias = None if bias is None else bias.to(dtype)
        self.rows, self.vocab = hidden.shape[0], weight.shape[0]
        self.step = chunk_rows(self.vocab)
        self.buffer = hidden.new_empty((min(self.step, self.rows), self.vocab), dtype=torch.float32)
        self.needs = needs
        self.grad_hidden = torch.empty_like(hidden) if needs[0] else None
        self.grad_weight = self.grad_bias = None

    def __iter__(self):
        return (slice(start, start + self.step) for start in range(0, self.rows, self.step))

    def logits(self, part: slice) -> torch.Tensor:
        """The fp32 logits of ``hidden[part]``, rounded in the compute dtype first, as stock's ``.float()``."""
        with torch.autocast(self.hidden.device.type, enabled=False):
            logits = F.linear(self.hidden[part], self.weight, self.bias)
        return self.buffer[: logits.shape[0]].copy_(logits)

    def add_grads(self, part: slice, grad: torch.Tensor) -> None:
        """The gradients from this chunk's logits' gradient ``grad`` (fp32)."""
        with torch.autocast(self.hidden.device.type, enabled=False):
            if self.grad_hidden is not None:
                rows = torch.mm(grad.to(self.weight.dtype), self.weight)
                self.grad_hidden[part] = rows
            if self.needs[1]:
                grad_t, inputs = grad.t().to(self.hidden.dtype), self.hidden[part]
                if self.grad_weight is None:
                    self.grad_weight = torch.mm(grad_t, inputs)
                else:
                    self.grad_weight.addmm_(grad_t, inputs)
            if self.needs[2]:
                sums = grad.sum(0)
                self.grad_bias = sums if self.grad_bias is None else self.grad_bias.add_(sums)

    def grads(self, weight: torch.Tensor) -> tuple:
        return self.grad_hidden, _to(self.grad_weight, weight.dtype), _to(self.grad_bias, weight.dtype)


def _scaled(grad: torch.Tensor | None, upstream: torch.Tensor) -> torch.Tensor | None:
    """``grad * upstream`` in ``grad``'s dtype; in an eager CPU backward ``grad`` itself for the usual upstream 1
    (``loss.backward()``): a weight-sized pass less (on a GPU, reading the value would synchronise; a trace cannot
    read it)."""
    if grad is None:
        return None
    eager_cpu = upstream.device.type == "cpu" and not torch.compiler.is_compiling()
    if eager_cpu and upstream.numel() == 1 and upstream.item() == 1.0:
        return grad
    return (grad * upstream).to(grad.dtype)


def _to(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """The cross-entropy of ``hidden @ weight.T + bias`` (``hidden``: rows x features) by chunks of rows."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index: int, smoothing: float, softcap: float, reduction: str):
        needs = tuple(ctx.needs_input_grad[:3])
        # per-row upstream gradients reach the weight only through each row: then the backward recomputes
        in_forward = reduction != "none" or not (needs[1] or needs[2])
        chunks = _Chunks(hidden, weight, bias, needs if in_forward else (False, False, False))
        impl = kernels.implementation(hidden.device)
        scale = 1.0 / (target != ignore_index).sum() if reduction == "mean" else None
        losses = hidden.new_empty(chunks.rows, dtype=torch.float32)
        for part in chunks:
            logits = chunks.logits(part)
            losses[part] = impl.cross_entropy_grad_(logits, target[part], ignore_index, smoothing, softcap)
            if in_forward:  # ``logits`` is now their gradient, scaled here as the loss is
                chunks.add_grads(part, logits if scale is None else logits.mul_(scale))
        ctx.set_materialize_grads(False)
        ctx.args = ignore_index, smoothing, softcap, reduction, in_forward
        ctx.save_for_backward(*(chunks.grads(weight) if in_forward else (hidden, weight, bias, target)))
        if reduction == "none":
            return losses
        total = losses.sum(dtype=torch.float64)  # rows' losses summed in fp64, returned in fp32
        return (total * scale if scale is not None else total).float()

    @staticmethod
    def backward(ctx, upstream: torch.Tensor | None):
        if upstream is None:
            return (None,) * 8
        refuse_double_backward("linear_cross_entropy")
        ignore_index, smoothing, softcap, reduction, in_forward = ctx.args
        upstream = upstream.float()
        if not in_forward:  # reduction "none" with a trainable weight or bias: each chunk again, scaled by row
            hidden, weight, bias, target = ctx.saved_tensors
            chunks = _Chunks(hidden, weight, bias, tuple(ctx.needs_input_grad[:3]))
            impl = kernels.implementation(hidden.device)
            for part in chunks:
                logits = chunks.logits(part)
                impl.cross_entropy_grad_(logits, target[part], ignore_index, smoothing, softcap)
                chunks.add_grads(part, logits.mul_(upstream[part].unsqueeze(1)))
            return (*chunks.grads(weight), *(None,) * 5)
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        rows = upstream.unsqueeze(1) if reduction == "none" else upstream
        return _scaled(grad_hidden, rows), _scaled(grad_weight, upstream), _scaled(grad_bias, upstream), *(None,) * 5


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, ...)`` without the logits: never more than
    one chunk of them exists (see the module docstring). With ``softcap`` the logits are first capped as Gemma 2
    caps them, ``softcap * tanh(logits / softcap)``. ``hidden``: ``(..., features)``; ``target``: ``(...)`` class
    indices (``ignore_index`` for none); ``reduction="none"`` returns the loss per row, in ``target``'s shape.
    Gradients flow to ``hidden``, ``weight`` and ``bias`` as they require them."""
    check_float_tensor("linear_cross_entropy", hidden)
    check_float_tensor("linear_cross_entropy", weight)
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not match"
        )
    if target.shape != hidden.shape[:-1] or target.dtype != torch.int64:
        raise ValueError(
            f"linear_cross_entropy: target must be int64 of shape {tuple(hidden.shape[:-1])}, got "
            f"{tuple(target.shape)} {target.dtype}"
        )
    if softcap is not None and not softcap > 0:
        raise ValueError(f"linear_cross_entropy: softcap must be positive, got {softcap}")
    rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    loss = LinearCrossEntropyFunction.apply(
        rows, weight, bias, target.reshape(-1), ignore_index, float(label_smoothing), float(softcap or 0.0), reduction
    )
    return loss.view(target.shape) if reduction == "none" else loss
