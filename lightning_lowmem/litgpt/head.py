"""LitGPT's training loss without its logits: ``chunked_cross_entropy(model(input_ids, ...), targets)`` through the
fused linear + cross-entropy.

LitGPT's finetune scripts compute the loss from the logits the model returns (in chunks of 128 positions: each
chunk's fp32 or bf16 ``positions x vocabulary`` logits stay alive for backward). A GPT given :class:`FusedLossHead`
returns instead, in a training forward, :class:`HiddenStates`: its final norm's output, which the scripts' own
steps carry unchanged (a list of one for ``lm_head_chunk_size``, ``[..., :-1, :]`` to drop the last position) into
:func:`chunked_cross_entropy`, installed in the script's namespace, which turns it into LitGPT's loss (targets
already shifted by the script, its ``ignore_index``, the sum over the positions to learn divided by their count,
at least 1; Gemma 2's final softcapping) by :func:`~lightning_lowmem.nn.causal_lm.causal_lm_loss`, inside the
head's own call (FSDP2 gathers a sharded head then). Evaluation, generation and calls without gradients run the
stock forward; logits any other code computes go to LitGPT's own ``chunked_cross_entropy``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem.nn.adapters import adapter_of, not_a_linear_head
from lightning_lowmem.nn.causal_lm import causal_lm_loss
from lightning_lowmem.surgery import fsdp

DROP_LAST = (Ellipsis, slice(None, -1, None), slice(None, None, None))  # LitGPT's shift: logits[..., :-1, :]


class HiddenStates:
    """The final norm's output of a training forward, standing in for the logits until the loss."""

    def __init__(self, head: FusedLossHead, hidden: torch.Tensor, drop_last: bool = False) -> None:
        self.head, self.hidden, self.drop_last = head, hidden, drop_last

    def __getitem__(self, index: Any) -> HiddenStates:
        if index != DROP_LAST or self.drop_last:
            raise TypeError(
                f"lightning_lowmem.litgpt: a training forward's logits are not computed (the loss is fused); only "
                f"LitGPT's logits[..., :-1, :] before chunked_cross_entropy is supported, not [{index!r}]"
            )
        return HiddenStates(self.head, self.hidden, drop_last=True)

    def loss(self, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """LitGPT's ``chunked_cross_entropy`` of these positions' logits against ``targets``."""
        return self.head.loss(self, targets, ignore_index)


def head_layer(model: nn.Module) -> nn.Module:
    """The layer whose weights give the LitGPT ``model``'s logits: its ``lm_head``, or that LoRA layer's plain
    linear when it has no adapter (``lora_head=False`` builds one with ``r=0``)."""
    head = model.lm_head
    linear = getattr(head, "linear", None)
    return linear if isinstance(linear, nn.Linear) and getattr(head, "r", None) == 0 else head


def head_refusal(model: nn.Module) -> str | None:
    """Why the fused loss cannot compute the LitGPT ``model``'s logits (``None``: it can)."""
    layer = head_layer(model)
    adapter = adapter_of(layer)
    return not_a_linear_head(layer) if adapter is None else adapter.head_refusal(layer)


class FusedLossHead:
    """Installed on a LitGPT GPT (see the module docstring): :meth:`forward` is the GPT's training forward,
    :meth:`head_forward` its head's (installed over whatever forward the head had, which evaluation still runs)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.head, self.layer = model, model.lm_head, head_layer(model)
        self.head_stock = model.lm_head.forward  # the head's forward until now (a LoRA forward the surgery put)
        self.capturing = False
        self.captured: torch.Tensor | None = None
        self.loss_args: dict[str, Any] | None = None
        self.head.forward = self.head_forward

    def forward(self, stock, idx: torch.Tensor, *args: Any, lm_head_chunk_size: int = 0, **kwargs: Any) -> Any:
        """The GPT's forward ``stock`` (bound), returning :class:`HiddenStates` in training with gradients."""
        if not (self.model.training and torch.is_grad_enabled()):
            return stock(idx, *args, lm_head_chunk_size=lm_head_chunk_size, **kwargs)
        self.capturing, self.captured = True, None
        try:
            stock(idx, *args, **kwargs)  # the head runs once, on the whole sequence, and returns no logits
        finally:
            captured, self.capturing, self.captured = self.captured, False, None
        hidden = HiddenStates(self, captured)
        return [hidden] if lm_head_chunk_size > 0 else hidden

    def head_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.loss_args is not None:
            return causal_lm_loss(x, self.layer, None, **self.loss_args)
        if self.capturing:
            self.captured = x
            return x.new_empty(0)  # what the model does with the logits (softcapping) costs nothing
        return self.head_stock(x)

    def loss(self, hidden: HiddenStates, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        positions = hidden.hidden.shape[-2] - (1 if hidden.drop_last else 0)
        if targets.shape[-1] != positions:
            raise ValueError(f"chunked_cross_entropy: {positions} positions of logits, targets {tuple(targets.shape)}")
        learned = (targets != ignore_index).sum()
        self.loss_args = {
            "shift_labels": F.pad(targets, (0, 1), value=ignore_index) if hidden.drop_last else targets,
            "ignore_index": ignore_index,
            "num_items_in_batch": learned.maximum(torch.ones_like(learned)),
            "softcap": self.model.config.final_logit_softcapping,
        }
        try:
            # through the head's call, where FSDP2's hooks gather a head sharded on its own; a head FSDP2 shards with
            # the root (LitGPT's parallelize_fn) was resharded after the forward: gathered for the loss's forward and
            # backward (FSDP2's end of backward reduces the root's gradients and reshards it)
            owner = self._owner()
            with fsdp.gathered(owner):
                loss = self.head(hidden.hidden)
            if owner is not None and loss.requires_grad:  # and again for its backward (a LoRA head's reads weights)
                loss.register_hook(lambda grad: owner.unshard())
            return loss
        finally:
            self.loss_args = None

    def _owner(self) -> nn.Module | None:
        """The FSDP2 module sharding the head with others (the root), or None (not sharded, or sharded on its own)."""
        from torch.distributed.fsdp import FSDPModule

        sharded_alone = isinstance(self.head, FSDPModule)
        return self.model if isinstance(self.model, FSDPModule) and not sharded_alone else None


def chunked_cross_entropy(
    logits: torch.Tensor | list[torch.Tensor] | HiddenStates | list[HiddenStates],
    targets: torch.Tensor,
    chunk_size: int = 128,
    ignore_index: int = -100,
) -> torch.Tensor:
    """``litgpt.utils.chunked_cross_entropy``, fused when ``logits`` are a converted GPT's :class:`HiddenStates`."""
    if isinstance(logits, list) and len(logits) == 1 and isinstance(logits[0], HiddenStates):
        logits = logits[0]
    if isinstance(logits, HiddenStates):
        return logits.loss(targets, ignore_index)
    from litgpt.utils import chunked_cross_entropy as stock

    return stock(logits, targets, chunk_size, ignore_index)
