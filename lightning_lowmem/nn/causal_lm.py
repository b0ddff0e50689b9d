"""A Hugging Face causal LM whose training loss never materialises the logits.

:class:`FusedLossForward` is installed as the model's ``forward`` by the surgery. In training, with ``labels``,
it runs the model's own forward without them while the head returns nothing but keeps its input, then computes
the loss from those hidden states with :func:`~lightning_lowmem.ops.linear_cross_entropy` and transformers'
causal LM semantics (:func:`causal_lm_loss`; Gemma 2's ``final_logit_softcapping`` included). The output's
``logits`` are then ``None``: no ``tokens x vocabulary`` tensor exists. Evaluation, generation, calls without
labels and ``return_dict=False`` run the stock forward unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem.ops.cross_entropy import linear_cross_entropy


def causal_lm_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    softcap: float | None = None,
    **_: Any,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` of ``head(hidden)`` against ``labels``, without the logits: each position
    predicts the next label (or ``shift_labels`` as given), ``ignore_index`` skipped, averaged, or summed and
    divided by ``num_items_in_batch`` when given."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = linear_cross_entropy(
        hidden, head.weight, shift_labels.to(hidden.device), getattr(head, "bias", None),
        ignore_index=ignore_index, reduction=reduction, softcap=softcap,
    )  # fmt: skip
    if num_items_in_batch is None:
        return loss
    return loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)


class FusedLossForward:
    """The causal LM ``model``'s forward with its training loss fused (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        stock = type(model).forward.__get__(model, type(model))
        labels = kwargs.get("labels")
        if labels is None or kwargs.get("return_dict") is False or not (model.training and torch.is_grad_enabled()):
            return stock(*args, **kwargs)
        head = model.get_output_embeddings()
        inputs: list[torch.Tensor] = []

        def keep_input(x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
            inputs.append(x)
            return x.new_empty(0)  # what the model does with the logits (softcapping) costs nothing

        head.forward = keep_input
        try:
            output = stock(*args, **{**kwargs, "labels": None})
        finally:
            del head.forward
        if len(inputs) != 1:
            raise RuntimeError(f"{type(model).__name__}: its head ran {len(inputs)} times in one forward, not once")
        softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
        loss = causal_lm_loss(
            inputs[0], head, labels, softcap=softcap, **{k: v for k, v in kwargs.items() if k != "labels"}
        )
        fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
        return type(output)(loss=loss, **fields)


def fused_loss_of(model: nn.Module) -> FusedLossForward | None:
    """The fused loss installed on ``model``, if any."""
    forward = model.__dict__.get("forward")
    return forward if isinstance(forward, FusedLossForward) else None
