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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lightning_lowmem import kernels
from lightning_lowmem.ops._checks import check_float_tensor, check_head, refuse_double_backward
from lightning_lowmem.ops.autocast import autocast_dtype

REDUCTIONS = ("mean", "sum", "none")
CHUNK_BYTES = 128 << 20
"""Logits per chunk (in the compute dtype), at least: enough rows that the chunk's matmuls run as fast as whole ones
(each chunk reads the whole weight; at 32 rows of a 64k vocabulary the head took 1.2-1.7x stock's time on CPU, at
128 MiB 0.6-1.0x), a small share of stock's logits and their gradient at long sequences. A chunk holds at least as
many logits as the weight has values: fewer, and reading the weight again for every chunk costs more than the
chunk's own work (a 131,072 x 1,024 fp32 head in chunks of 128 MiB took 0.98x stock's time, in one of 512 MiB
0.89x)."""


def chunk_rows(vocab: int, features: int, itemsize: int = 4) -> int:
    """Rows per chunk: :data:`CHUNK_BYTES` of logits of ``itemsize`` bytes, or the weight's ``vocab x features``
    values if more; at least 8."""
    return max(8, max(CHUNK_BYTES // itemsize, vocab * features) // max(vocab, 1))


class HeadChunks:
    """The head's terms ``(input, weight)`` (the hidden states and the head's weight, then a LoRA adapter's scaled
    ``lora_A`` output and ``lora_B`` weight) in the compute dtype (autocast's, else the promoted one, as
    ``F.linear`` would run), cast once, and what each chunk of rows needs: its logits ``sum(input @ weight.T) +
    bias`` in the compute dtype (as stock's before its ``.float()``; fp32 for fp64), written into one reused buffer,
    then from their gradient (which the cross-entropy step writes over them, in that dtype) each input's gradient
    rows and each weight's and the bias's gradient, accumulated in place: a weight's in ``accum_dtype`` (default
    the compute dtype), each chunk's product computed in the compute dtype and added (in the compute dtype itself,
    added by ``addmm_``: no weight-sized temporary per chunk, but the rounding error grows with the chunks)."""

    def __init__(
        self,
        terms: list[tuple[torch.Tensor, torch.Tensor]],
        bias,
        needs: tuple[bool, ...],
        accum_dtype: torch.dtype | None = None,
    ) -> None:
        hidden, weight = terms[0]
        dtype = autocast_dtype(hidden) or torch.promote_types(hidden.dtype, weight.dtype)
        self.accum_dtype = accum_dtype or dtype
        self.terms = [(i.to(dtype), w.to(dtype)) for i, w in terms]
        self.bias = None if bias is None else bias.to(dtype)
        self.rows, self.vocab = hidden.shape[0], weight.shape[0]
        kept = dtype if dtype in kernels.torch_ops.CROSS_ENTROPY_DTYPES else torch.float32
        self.step = chunk_rows(self.vocab, weight.shape[1], kept.itemsize)
        self.buffer = hidden.new_empty((min(self.step, self.rows), self.vocab), dtype=kept)
        self.needs = needs  # per input, weight of each term, then the bias
        self.sums: list[torch.Tensor | None] = [None] * len(needs)  # the weights' and the bias's gradients
        self.input_grads = [torch.empty_like(i) if needs[2 * k] else None for k, (i, _) in enumerate(terms)]

    def __iter__(self):
        return (slice(start, start + self.step) for start in range(0, self.rows, self.step))

    def logits(self, part: slice) -> torch.Tensor:
        """The logits of rows ``part`` in the buffer, computed in the compute dtype, as stock's before ``.float()``."""
        (hidden, weight), *low_rank = self.terms
        rows = hidden[part]
        out = self.buffer[: rows.shape[0]]
        with torch.autocast(hidden.device.type, enabled=False):
            if low_rank or out.dtype != rows.dtype:  # an adapter's term rounded apart, as stock adds it
                logits = F.linear(rows, weight, self.bias)
                for inputs, low_weight in low_rank:
                    logits = logits + F.linear(inputs[part], low_weight)
                return out.copy_(logits)
            if self.bias is None:
                return torch.mm(rows, weight.t(), out=out)
            return torch.addmm(self.bias, rows, weight.t(), out=out)

    def add_grads(self, part: slice, grad: torch.Tensor) -> None:
        """The gradients from this chunk's logits' gradient ``grad`` (in the buffer's dtype)."""
        with torch.autocast(grad.device.type, enabled=False):
            for k, (inputs, weight) in enumerate(self.terms):
                low = grad.to(weight.dtype)
                if self.input_grads[k] is not None:
                    self.input_grads[k][part] = torch.mm(low, weight)
                if self.needs[2 * k + 1]:
                    self._accumulate(2 * k + 1, low.t(), inputs[part])
            if self.needs[-1]:
                sums = grad.sum(0, dtype=torch.float32)
                self.sums[-1] = sums if self.sums[-1] is None else self.sums[-1].add_(sums)

    def _accumulate(self, index: int, grad_t: torch.Tensor, inputs: torch.Tensor) -> None:
        if self.sums[index] is None:  # one chunk of all rows: nothing to accumulate
            product = torch.mm(grad_t, inputs)
            self.sums[index] = product if self.rows <= self.step else product.to(self.accum_dtype)
        elif self.sums[index].dtype == inputs.dtype:
            self.sums[index].addmm_(grad_t, inputs)
        else:
            self.sums[index].add_(torch.mm(grad_t, inputs))

    def grads(self, operands: tuple[torch.Tensor, ...], bias: torch.Tensor | None) -> list[torch.Tensor | None]:
        """The gradient of each operand (inputs and weights, in their dtypes), then the bias's: zeros for one that
        needs a gradient and had no row (an empty batch), as stock's."""
        found = [self.input_grads[k // 2] if k % 2 == 0 else self.sums[k] for k in range(len(operands))]
        found.append(self.sums[-1])
        return [
            (torch.zeros_like(t) if need else None) if g is None else g.to(t.dtype)
            for g, t, need in zip(found, (*operands, bias), self.needs)
        ]


def _scaled(grad: torch.Tensor | None, upstream: torch.Tensor) -> torch.Tensor | None:
    """``grad * upstream`` in ``grad``'s dtype; in an eager CPU backward ``grad`` itself for the usual upstream 1
    (``loss.backward()``): a weight-sized pass less (on a GPU, reading the value would synchronise; a trace cannot
    read it)."""
    if grad is None:
        return None
    eager_cpu = kernels.takes_host_side(upstream) and not torch.compiler.is_compiling()
    if eager_cpu and upstream.numel() == 1 and upstream.item() == 1.0:
        return grad
    return (grad * upstream).to(grad.dtype)


def _needs(ctx) -> tuple[bool, ...]:
    """Which of ``LinearCrossEntropyFunction``'s operands, then its bias, need a gradient."""
    return (*ctx.needs_input_grad[_OPERANDS:], ctx.needs_input_grad[_OPERANDS - 1])


@dataclass(frozen=True)
class _Loss:
    """What the loss of a row is: F.cross_entropy's with ``ignore_index``, ``smoothing`` and ``softcap`` (Gemma 2's),
    times the weight of its target class (``class_weight``), plus ``z_loss * logsumexp(logits)^2`` (PaLM's)."""

    ignore_index: int
    smoothing: float
    softcap: float
    z_loss: float
    class_weight: torch.Tensor | None

    def row_weights(self, target: torch.Tensor) -> torch.Tensor:
        """Each row's weight: its target class's (1 without class weights), 0 where ignored."""
        kept = target != self.ignore_index
        if self.class_weight is None:
            return kept.float()
        return self.class_weight.float().gather(0, target.masked_fill(~kept, 0)) * kept

    def step(self, impl, logits: torch.Tensor, target: torch.Tensor, ce_scale, z_scale) -> tuple[torch.Tensor, float]:
        """Turn ``logits`` (a chunk, in the buffer) in place into the gradient of the rows' loss, its cross-entropy
        part scaled by ``ce_scale`` and its z-loss part by ``z_scale`` (numbers, or one per row); return the rows'
        losses (unscaled) and their z-loss part's sum."""
        z_grad = None
        if self.z_loss:  # d(lse^2)/dlogits = 2 lse softmax(capped) (1 - tanh^2) before the kernel overwrites them
            rows = logits.to(torch.float32, copy=True)
            squash = torch.tanh(rows / self.softcap) if self.softcap else None
            capped = rows if squash is None else squash * self.softcap
            lse = torch.logsumexp(capped, dim=1)
            z_grad = capped.sub_(lse.unsqueeze(1)).exp_()
            if squash is not None:
                z_grad.mul_(1 - squash.square_())
        weights = None if self.class_weight is None else self.row_weights(target)
        scale = ce_scale if weights is None else weights * ce_scale
        if isinstance(scale, torch.Tensor):
            scale = scale.float().expand(len(target)).contiguous()
        else:  # the sum's (and the forward's of "none"): 1
            scale = None
        losses = impl.cross_entropy_grad_(logits, target, self.ignore_index, self.smoothing, self.softcap, scale)
        if weights is not None:
            losses = losses * weights
        if z_grad is None:
            return losses, 0.0
        kept = target != self.ignore_index
        logits.add_(z_grad.mul_((2 * self.z_loss * z_scale * lse * kept).unsqueeze(1)))
        z_rows = self.z_loss * lse.square() * kept
        return losses + z_rows, z_rows.sum(dtype=torch.float64)


def _accuracy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """How many rows' largest logit is their target's (ignored rows not counted)."""
    return ((logits.argmax(1) == target) & (target != ignore_index)).sum()


_OPERANDS = 10  # LinearCrossEntropyFunction's arguments before its operands (the bias is the last of them)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """The cross-entropy of ``sum(input @ weight.T) + bias`` over the terms ``operands = (hidden, weight[, lora
    input, lora weight])`` (inputs: rows x features), by chunks of rows. Returns the loss and, with ``accuracy``,
    the share of kept rows whose largest logit is their target's (else an empty tensor)."""

    @staticmethod
    def forward(
        ctx, target, class_weight, ignore_index, smoothing, softcap, z_loss, reduction, accuracy, accum_dtype, bias,
        *operands,
    ):  # fmt: skip
        loss = _Loss(ignore_index, smoothing, softcap, z_loss, class_weight)
        needs = _needs(ctx)
        terms = list(zip(operands[::2], operands[1::2]))
        # per-row upstream gradients reach a weight only through each row: then the backward recomputes
        in_forward = reduction != "none" or not any(needs[1::2])
        chunks = HeadChunks(terms, bias, needs if in_forward else (False,) * len(needs), accum_dtype)
        impl = kernels.head_implementation(target.device)
        kept = (target != loss.ignore_index).sum()
        weights = loss.row_weights(target).sum() if loss.class_weight is not None else kept
        if reduction == "mean":  # nothing to learn (no kept row, zero weights): a NaN loss, as stock's, zero gradients
            ce_scale, z_scale = _reciprocal(weights), _reciprocal(kept)
        else:
            ce_scale = z_scale = 1.0
        losses = target.new_empty(chunks.rows, dtype=torch.float32)
        correct, z_total = target.new_zeros(()), 0.0
        for part in chunks:
            logits = chunks.logits(part)
            if accuracy:
                correct += _accuracy(logits, target[part], loss.ignore_index)
            losses[part], z_part = loss.step(impl, logits, target[part], ce_scale, z_scale)
            z_total = z_total + z_part
            if in_forward:  # ``logits`` is now their gradient, scaled as the loss is
                chunks.add_grads(part, logits)
        ctx.set_materialize_grads(False)
        ctx.args = loss, reduction, in_forward
        saved = chunks.grads(operands, bias) if in_forward else (target, bias, *operands)
        ctx.save_for_backward(*saved)
        share = correct / kept if accuracy else losses.new_empty(0)
        ctx.mark_non_differentiable(share)
        if reduction == "none":
            return losses, share
        total = losses.sum(dtype=torch.float64)  # rows' losses summed in fp64, returned in fp32
        if reduction == "sum":
            return total.float(), share
        return ((total - z_total) / weights + z_total / kept).float(), share  # the mean's parts: each its count

    @staticmethod
    def backward(ctx, upstream: torch.Tensor | None, _):
        loss, reduction, in_forward = ctx.args
        if upstream is None:
            return (None,) * len(ctx.needs_input_grad)
        refuse_double_backward("linear_cross_entropy")
        upstream = upstream.float()
        if not in_forward:  # reduction "none" with a trainable weight or bias: each chunk again, scaled by row
            target, bias, *operands = ctx.saved_tensors
            chunks = HeadChunks(list(zip(operands[::2], operands[1::2])), bias, _needs(ctx))
            impl = kernels.head_implementation(target.device)
            for part in chunks:
                logits = chunks.logits(part)
                loss.step(impl, logits, target[part], upstream[part], upstream[part])
                chunks.add_grads(part, logits)
            *grads, grad_bias = chunks.grads(operands, bias)
            return (None,) * (_OPERANDS - 1) + (grad_bias, *grads)
        *grads, grad_bias = ctx.saved_tensors
        rows = upstream.unsqueeze(1) if reduction == "none" else upstream
        scaled = [_scaled(g, rows if k % 2 == 0 else upstream) for k, g in enumerate(grads)]
        return (None,) * (_OPERANDS - 1) + (_scaled(grad_bias, upstream), *scaled)


def _reciprocal(count: torch.Tensor) -> torch.Tensor:
    """``1 / count``, 0 where ``count`` is 0 (every row ignored: their gradients are 0, not NaN)."""
    return count.float().reciprocal().nan_to_num(posinf=0.0)


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
    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
    class_weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    accum_dtype: torch.dtype | None = torch.float32,
    return_accuracy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, ...)`` without the logits: never more than
    one chunk of them exists (see the module docstring). With ``softcap`` the logits are first capped as Gemma 2
    caps them, ``softcap * tanh(logits / softcap)``. ``hidden``: ``(..., features)``; ``target``: ``(...)`` class
    indices (``ignore_index`` for none); ``reduction="none"`` returns the loss per row, in ``target``'s shape.
    ``lora=(a, b)`` adds a LoRA adapter's term ``a @ b.T`` to the logits (``a``: the scaled ``lora_A`` output,
    ``(..., rank)``; ``b``: ``lora_B``'s weight, ``vocab x rank``), as peft's adapted head adds it. Gradients flow
    to every tensor that requires them; rows with nothing to learn (every target ignored, or of weight 0) get zero
    gradients, and their mean loss is NaN, as stock's.

    ``class_weight``: a weight per class, as ``F.cross_entropy``'s ``weight`` (each row's loss times its target's
    weight; the mean divides by the kept rows' weights); not with ``label_smoothing``. ``z_loss``: adds
    ``z_loss * logsumexp(logits)^2`` per kept row (PaLM's z-loss; its mean is over the kept rows). ``accum_dtype``:
    the dtype the weight's gradient is accumulated in over the chunks (default fp32: its error does not grow with
    their number; ``None``: the compute dtype, no weight-sized fp32 buffer). ``return_accuracy``: also return the
    share of kept rows whose largest logit is their target's (no gradient)."""
    check_head("linear_cross_entropy", hidden, weight, target)
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"linear_cross_entropy: softcap must be positive, got {softcap}")
    operands = [hidden.reshape(-1, hidden.shape[-1]).contiguous(), weight]
    if lora is not None:
        a, b = lora
        check_float_tensor("linear_cross_entropy", a)
        check_float_tensor("linear_cross_entropy", b)
        if b.dim() != 2 or a.shape != (*hidden.shape[:-1], b.shape[1]) or b.shape[0] != weight.shape[0]:
            raise ValueError(
                f"linear_cross_entropy: lora ({tuple(a.shape)}, {tuple(b.shape)}) does not match hidden "
                f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}: want ((..., rank), (vocab, rank))"
            )
        operands += [a.reshape(-1, a.shape[-1]).contiguous(), b]
    if class_weight is not None:
        if class_weight.shape != (weight.shape[0],) or not class_weight.is_floating_point():
            raise ValueError(
                f"linear_cross_entropy: class_weight must be a float tensor of one weight per class "
                f"({weight.shape[0]},), got {tuple(class_weight.shape)} {class_weight.dtype}"
            )
        if label_smoothing:
            raise ValueError("linear_cross_entropy: class_weight with label_smoothing is not supported")
    if not z_loss >= 0:
        raise ValueError(f"linear_cross_entropy: z_loss must be >= 0, got {z_loss}")
    loss, accuracy = LinearCrossEntropyFunction.apply(
        target.reshape(-1), class_weight, ignore_index, float(label_smoothing), float(softcap or 0.0), float(z_loss),
        reduction, return_accuracy, accum_dtype, bias, *operands,
    )  # fmt: skip
    loss = loss.view(target.shape) if reduction == "none" else loss
    return (loss, accuracy) if return_accuracy else loss
