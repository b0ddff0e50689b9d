"""LitGPT's LoRA layers (``LoRALinear``, ``LoRAQKVLinear``) and its attention, in one place.

litgpt is never imported: its layers are recognised by what they hold (a ``linear`` child, ``lora_A`` and
``lora_B`` Parameters, ``scaling``, ``merged``). Their forward computes the adapter as ``dropout(x) @ A.T @ B.T``
with the Parameters themselves, so the adapter saves its own (dropped) copy of ``x``. :class:`LoRAForward`,
installed as such a layer's forward, computes the same with ``x @ A.T`` as a shared linear: with ``x`` a
memory-sharing norm's output it saves the norm's ``z``, and a folded dropout saves a seed, not a dropped copy.
The layer keeps its class, its parameters and LitGPT's ``merge()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_lowmem.nn.adapters import Fold, ForwardAdapter, not_a_linear_head
from lightning_lowmem.nn.linear import shared_linear
from lightning_lowmem.nn.norm import MemorySharingNorm
from lightning_lowmem.ops.dropout import check_probability


def is_lora_layer(module: nn.Module) -> bool:
    """A LitGPT LoRA layer with an adapter (``r > 0``): a ``linear`` child and ``lora_A`` / ``lora_B`` Parameters."""
    return (
        isinstance(getattr(module, "linear", None), nn.Linear)
        and isinstance(getattr(module, "lora_A", None), nn.Parameter)
        and isinstance(getattr(module, "lora_B", None), nn.Parameter)
        and hasattr(module, "scaling")
        and hasattr(module, "merged")
    )


def adapts(layer: nn.Module) -> bool:
    """Whether the LoRA ``layer`` adds its adapter now (not merged, and some of q, k, v enabled for a QKV layer)."""
    return layer.r > 0 and not layer.merged and any(getattr(layer, "enable_lora", (True,)))


def dropout_probability(layer: nn.Module) -> float:
    """The probability of the LoRA ``layer``'s dropout in training (``lora_dropout=0`` is a plain function)."""
    dropout = layer.lora_dropout
    return float(dropout.p) if isinstance(dropout, nn.Dropout) else 0.0


def saves_its_input(layer: nn.Module) -> bool:
    """Whether the LoRA ``layer`` saves its very input: a trainable base weight, or a trainable adapter whose
    input is not dropped (a dropout folded into :class:`LoRAForward` is the identity: it saves the input and a
    seed)."""
    if layer.linear.weight.requires_grad:
        return True
    return adapts(layer) and layer.lora_A.requires_grad and dropout_probability(layer) == 0


class LitGPTLoRA(ForwardAdapter):
    name = "LitGPT"

    def matches(self, layer: nn.Module) -> bool:
        return is_lora_layer(layer)

    def saves_its_input(self, layer: nn.Module) -> bool:
        return saves_its_input(layer)

    def reads_linearly(self, layer: nn.Module) -> bool:
        return True  # through LoRAForward's shared x @ A.T; its frozen linear saves nothing, a trained one the input

    def folds(self, layer: nn.Module) -> Iterator[Fold]:
        p = dropout_probability(layer)
        if p > 0:
            yield Fold("lora_dropout", "lora_A", p, by_forward=True)  # into LoRAForward's x @ A.T

    def forward(self, layer: nn.Module, norm: MemorySharingNorm | None, dropout: float) -> LoRAForward:
        return LoRAForward(layer, norm, dropout)

    def installed(self, layer: nn.Module) -> bool:
        return lora_forward_of(layer) is not None

    def head_refusal(self, layer: nn.Module) -> str | None:
        if hasattr(layer, "zero_pad"):
            return "its head is a LitGPT LoRAQKVLinear, not a linear layer (kept stock, with its logits)"
        return not_a_linear_head(layer.linear)

    def head_operands(self, layer: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """The base weight and bias and the adapter's term ``(dropout(hidden) @ A.T * scaling, B)``, as LitGPT's
        ``LoRALinear`` computes it."""
        base = layer.linear
        if not adapts(layer):
            return base.weight, base.bias, None
        forward = lora_forward_of(layer)  # its dropout folded there, if the surgery put it
        after_a = layer.lora_dropout(hidden) @ layer.lora_A.T if forward is None else forward.after_a(hidden)
        return base.weight, base.bias, (after_a * layer.scaling, layer.lora_B)


class LoRAForward:
    """The forward of a LitGPT LoRA ``layer``: LitGPT's, with the adapter's ``x @ A.T`` sharing ``norm``'s ``z``
    (when ``x`` is its output) and taking in a dropout of probability ``dropout`` (the layer's own, folded: its
    ``lora_dropout`` is then the identity)."""

    def __init__(self, layer: nn.Module, norm: MemorySharingNorm | None, dropout: float = 0.0) -> None:
        self.layer, self.norm = layer, norm
        self.dropout = check_probability("LoRAForward", dropout)
        self.per_qkv = hasattr(layer, "zero_pad")  # LoRAQKVLinear: B per enabled q / k / v, zero-padded

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        pretrained = layer.linear(x)
        if not adapts(layer):
            return pretrained
        after_a = self.after_a(x)
        if self.per_qkv:
            after_b = layer.conv1d(after_a.transpose(-2, -1), layer.lora_B.unsqueeze(-1)).transpose(-2, -1)
            return pretrained + layer.zero_pad(after_b) * layer.scaling
        return pretrained + (after_a @ layer.lora_B.transpose(0, 1)) * layer.scaling

    def after_a(self, x: torch.Tensor) -> torch.Tensor:
        """``dropout(x) @ A.T``, the dropout folded (a seed saved) or the layer's own, ``x`` shared with the norm."""
        layer = self.layer
        dropped = x if self.dropout else layer.lora_dropout(x)
        return shared_linear(dropped, layer.lora_A, None, self.norm, self.dropout if layer.training else 0.0)


def lora_forward_of(layer: nn.Module) -> LoRAForward | None:
    """The :class:`LoRAForward` installed on ``layer``, if any."""
    forward = layer.__dict__.get("forward")
    return forward if isinstance(forward, LoRAForward) else None


def is_attention(module: nn.Module) -> bool:
    """A LitGPT ``CausalSelfAttention``: a ``qkv`` and a ``proj`` child, and its ``scaled_dot_product_attention``."""
    return (
        isinstance(getattr(module, "qkv", None), nn.Module)
        and isinstance(getattr(module, "proj", None), nn.Module)
        and callable(getattr(type(module), "scaled_dot_product_attention", None))
        and hasattr(module, "config")
    )


class AttentionLayout:
    """LitGPT attention's ``scaled_dot_product_attention`` with its inputs laid out to save less, installed on
    the instance. LitGPT splits one ``qkv`` output into views: attention saves ``v``, a view that holds all of
    ``qkv`` alive, so ``v`` is handed over compact (one copy, three times smaller than what it frees). Its ``q``
    (after RoPE, ``(B, H, T, D)``-contiguous) goes in as a ``(B, T, H, D)`` layout, so that the output comes
    back in it too and the reshape before ``proj`` is a view of the tensor attention saves anyway, not a copy
    that ``proj``'s adapter saves as well. The results are the same bits."""

    def __init__(self, attention: nn.Module) -> None:
        self.attention = attention

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        v = v.contiguous()  # a view of qkv is not; a compact v (GQA's repeat_interleave) stays as it is
        if q.dim() == 4 and q.is_contiguous():
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        return type(self.attention).scaled_dot_product_attention(self.attention, q, k, v, mask)


def attention_layout_of(attention: nn.Module) -> AttentionLayout | None:
    """The :class:`AttentionLayout` installed on ``attention``, if any."""
    installed = attention.__dict__.get("scaled_dot_product_attention")
    return installed if isinstance(installed, AttentionLayout) else None


ADAPTER = LitGPTLoRA()
