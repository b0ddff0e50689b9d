"""A Hugging Face causal LM whose training loss never materialises the logits.

:class:`FusedLossForward` is installed as the model's ``forward`` by the surgery. In training, with ``labels``,
it runs the model's own forward without them while the head, called as usual, returns nothing but computes the
loss from its input with :func:`~lightning_lowmem.ops.linear_cross_entropy` and the model's own loss semantics
(:func:`causal_lm_loss`: transformers' shifted labels or labels as given, a logit scale, Gemma 2's
``final_logit_softcapping``; the surgery finds them by computing the model's loss, :class:`LossSemantics`). The output's
``logits`` are then ``None``: no ``tokens x vocabulary`` tensor exists. Evaluation, generation, calls without
labels and ``return_dict=False`` run the stock forward unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem.nn.adapters import adapter_of, linear_head_operands, not_a_linear_head
from lightning_lowmem.ops.cross_entropy import linear_cross_entropy
from lightning_lowmem.ops.log_probs import linear_log_probs


def causal_lm_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    softcap: float | None = None,
    semantics: LossSemantics | None = None,
    **_: Any,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` of ``head(hidden)`` against ``labels``, without the logits: each position
    predicts the next label (or ``shift_labels`` as given), ``ignore_index`` skipped, averaged, or summed and
    divided by ``num_items_in_batch`` when given; the logits scaled and the labels shifted as ``semantics`` says
    (the model's own: :class:`LossSemantics`)."""
    semantics = semantics or LossSemantics()
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:] if semantics.shift else labels
    reduction = "sum" if num_items_in_batch is not None else "mean"
    if semantics.scale != 1.0:  # scale * (h W^T + b) = (scale * h) W^T + scale * b, the adapter's term linear in h too
        hidden = hidden * semantics.scale
    weight, bias, lora = head_operands(head, hidden)
    bias = bias * semantics.scale if bias is not None and semantics.scale != 1.0 else bias
    loss = linear_cross_entropy(
        hidden, weight, shift_labels.to(hidden.device), bias,
        ignore_index=ignore_index, reduction=reduction, softcap=softcap, lora=lora,
    )  # fmt: skip
    if num_items_in_batch is None:
        return loss
    return loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)


@dataclass(frozen=True)
class LossSemantics:
    """What a causal LM's training loss computes beyond ``cross_entropy(logits, labels)``: whether position ``t``
    predicts label ``t + 1`` (``shift``; the BART family, XLM and XLNet take ``labels`` as already shifted) and the
    factor the logits are multiplied by (``scale``: Cohere's ``logit_scale``). Gemma 2's softcapping comes from its
    config (``final_logit_softcapping``)."""

    shift: bool = True
    scale: float = 1.0


def head_operands(head: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """The ``head``'s weight and bias as :func:`linear_cross_entropy` takes them and, for a LoRA-adapted head, its
    adapter's term ``(scaling * lora_A(dropout(hidden)), lora_B.weight)`` (its library's adapter computes it)."""
    adapter = adapter_of(head)
    return linear_head_operands(head) if adapter is None else adapter.head_operands(head, hidden)


def gathered_for_backward(head: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """``loss``, the head's real output, marked as DeepSpeed ZeRO-3 marks a module's outputs (its ``pre_bwd_fn``):
    the head's partitioned parameters are gathered again before the loss's backward computes their gradients. (The
    model's code gets an empty tensor for logits, which ZeRO-3 marks too, but which no loss depends on.)"""
    mark = vars(head).get("pre_bwd_fn")
    return loss if mark is None or not loss.requires_grad else mark.apply(loss)


class FusedLossForward:
    """The causal LM ``model``'s forward with its training loss fused (see the module docstring).

    :meth:`head_forward` is installed as the ``head``'s forward too: during a fused call it computes the loss from
    its input instead of the logits, inside the head's own call, so that a head FSDP2 shards on its own is
    gathered then. Both stay installed (no patching per call): ``torch.compile`` traces a training step whole."""

    def __init__(self, model: nn.Module, head: nn.Module, semantics: LossSemantics = LossSemantics()) -> None:
        self.model, self.head, self.semantics = model, head, semantics
        self.loss_args: dict[str, Any] | None = None  # set during a fused call
        self.losses: list[torch.Tensor] = []

    def head_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.loss_args is None:
            return type(self.head).forward(self.head, x, *args, **kwargs)
        self.losses.append(gathered_for_backward(self.head, causal_lm_loss(x, self.head, **self.loss_args)))
        return x.new_empty(0)  # what the model does with the logits (softcapping) costs nothing

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        stock = partial(type(model).forward, model)  # not __get__: dynamo before torch 2.14 cannot trace it
        labels = kwargs.get("labels")
        if labels is None or kwargs.get("return_dict") is False or not (model.training and torch.is_grad_enabled()):
            return stock(*args, **kwargs)
        softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
        self.loss_args, self.losses = {**kwargs, "softcap": softcap, "semantics": self.semantics}, []
        try:
            output = stock(*args, **{**kwargs, "labels": None})
        finally:
            losses, self.loss_args, self.losses = self.losses, None, []
        if len(losses) != 1:
            raise RuntimeError(f"{type(model).__name__}: its head ran {len(losses)} times in one forward, not once")
        fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
        return type(output)(loss=losses[0], **fields)


def causal_lm_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    **model_kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Each position's log-prob of the next label (``labels`` shifted as transformers' causal LM loss shifts them;
    ``ignore_index`` gives 0 and no gradient), ``(batch, tokens - 1)`` in fp32, and with ``return_entropy`` the
    entropy of each position's distribution: what DPO, KTO and GRPO losses are written on, computed by
    :func:`~lightning_lowmem.ops.linear_log_probs` from the backbone's last hidden states and the head's weight,
    so that no ``tokens x vocabulary`` tensor exists. ``model``: a Hugging Face causal LM (converted or not, peft
    adapters on its body included); under ``torch.no_grad()`` (a frozen reference model) nothing is saved either.
    A model whose logits are scaled or capped, or whose head carries an adapter, is refused with the reason."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    scaled = [
        name for name in ("final_logit_softcapping", "logit_scale") if getattr(config, name, None) not in (None, 1.0)
    ]
    head = base.get_output_embeddings()
    if scaled or head is None or (adapter_of(head) is None and not_a_linear_head(head)):
        reason = f"its logits are changed by {', '.join(scaled)}" if scaled else "its head is not a linear layer"
        raise ValueError(f"causal_lm_log_probs: {type(base).__name__} is not supported: {reason}")
    backbone = getattr(base, base.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs).last_hidden_state[:, :-1]
    weight, bias, lora = head_operands(head, hidden)
    if lora is not None:
        raise ValueError("causal_lm_log_probs: a head with a LoRA adapter is not supported yet (adapt the body only)")
    return linear_log_probs(
        hidden, weight, labels[:, 1:].to(hidden.device), bias,
        temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy,
    )  # fmt: skip


def fused_loss_of(model: nn.Module) -> FusedLossForward | None:
    """The fused loss installed on ``model``, if any."""
    forward = model.__dict__.get("forward")
    return forward if isinstance(forward, FusedLossForward) else None
