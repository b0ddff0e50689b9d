"""Per-token log-probs (and entropies) of a linear head, without the logits: what DPO, KTO, GRPO and distillation
losses are written on.

Stock ``F.log_softmax(F.linear(hidden, weight).float() / temperature, -1).gather(-1, target)`` keeps ``rows x
vocabulary`` fp32 values for backward (its log-softmax output, and the logits before it): with 8 completions of
1,024 tokens at a 152k vocabulary, 5 GB per prompt, for the policy and often the reference model. Here the forward
computes each chunk of rows' logits, turns them into the rows' log-probs, entropies and log-sum-exps (the backend's
``token_log_probs``) and drops them; the backward recomputes each chunk (one matmul more than stock, as Cut
Cross-Entropy does: the loss on the log-probs is the caller's, so their gradient is known only then), turns it in
place into its gradient (``token_log_probs_grad_``) and into the gradients of the hidden states, weight and bias.
Saved: the hidden states (which the stock linear saves too), the targets and two fp32 values per row.
"""

from __future__ import annotations

import torch

from lightning_lowmem import kernels
from lightning_lowmem.ops._checks import check_head, refuse_double_backward
from lightning_lowmem.ops.cross_entropy import HeadChunks


class LinearLogProbsFunction(torch.autograd.Function):
    """The log-prob of each row's target and the entropy of each row's distribution under ``softmax((hidden @
    weight.T + bias) / temperature)`` (hidden: rows x features), by chunks of rows; with ``top1``, whether the
    target is the row's largest logit (else an empty tensor)."""

    @staticmethod
    def forward(ctx, target, ignore_index, temperature, top1, bias, hidden, weight):
        chunks = HeadChunks([(hidden, weight)], bias, (False, False, False))
        impl = kernels.head_implementation(target.device)
        log_probs, entropy, lse = (hidden.new_empty(chunks.rows, dtype=torch.float32) for _ in range(3))
        is_top1 = torch.empty(chunks.rows if top1 else 0, dtype=torch.bool, device=target.device)
        for part in chunks:
            logits = chunks.logits(part)
            if top1:
                is_top1[part] = (logits.argmax(1) == target[part]) & (target[part] != ignore_index)
            log_probs[part], entropy[part], lse[part] = impl.token_log_probs(
                logits, target[part], ignore_index, temperature
            )
        ctx.set_materialize_grads(False)
        ctx.args = ignore_index, temperature
        ctx.save_for_backward(target, lse, entropy, bias, hidden, weight)
        ctx.mark_non_differentiable(is_top1)
        return log_probs, entropy, is_top1

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, _):
        refuse_double_backward("linear_log_probs")
        target, lse, entropy, bias, hidden, weight = ctx.saved_tensors
        needs = (*ctx.needs_input_grad[5:7], ctx.needs_input_grad[4])
        if (grad_log_probs is None and grad_entropy is None) or not any(needs):
            return (None,) * 7
        ignore_index, temperature = ctx.args
        per_row = [None if g is None else g.float().contiguous() for g in (grad_log_probs, grad_entropy)]
        if per_row[0] is None:
            per_row[0] = torch.zeros_like(lse)
        chunks = HeadChunks([(hidden, weight)], bias, needs, accum_dtype=torch.float32)
        impl = kernels.head_implementation(target.device)
        for part in chunks:
            logits = chunks.logits(part)
            grad_entropy_part = None if per_row[1] is None else per_row[1][part]
            impl.token_log_probs_grad_(
                logits, target[part], lse[part], entropy[part], per_row[0][part], grad_entropy_part, ignore_index,
                temperature,
            )  # fmt: skip
            chunks.add_grads(part, logits)
        grad_hidden, grad_weight, grad_bias = chunks.grads((hidden, weight), bias)
        return None, None, None, None, grad_bias, grad_hidden, grad_weight


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_top1: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``F.log_softmax(F.linear(hidden, weight, bias).float() / temperature, -1)`` at ``target``, without the logits:
    never more than one chunk of them exists (see the module docstring). ``hidden``: ``(..., features)``;
    ``target``: ``(...)`` class indices (``ignore_index`` for none: its log-prob and entropy are 0, with no
    gradient). Returns the fp32 log-probs in ``target``'s shape and, with ``return_entropy``, the entropy of each
    row's distribution (``-sum(p * log p)``, an RL entropy bonus) and, with ``return_top1``, whether each target is
    its row's largest logit (bool, False where ignored: the token accuracy). Gradients flow to ``hidden``, ``weight`` and
    ``bias`` (those that require them), exact to fp32 rounding: any loss written on log-probs (DPO, KTO, GRPO,
    distillation, your own) gets the head's memory of a fused cross-entropy."""
    check_head("linear_log_probs", hidden, weight, target)
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"linear_log_probs: bias must have {weight.shape[0]} values, got {tuple(bias.shape)}")
    if not temperature > 0:
        raise ValueError(f"linear_log_probs: temperature must be positive, got {temperature}")
    rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    found = LinearLogProbsFunction.apply(
        target.reshape(-1).contiguous(), ignore_index, float(temperature), return_top1, bias, rows, weight
    )
    wanted = [True, return_entropy, return_top1]
    outputs = [values.view(target.shape) for values, want in zip(found, wanted) if want]
    return outputs[0] if len(outputs) == 1 else tuple(outputs)
