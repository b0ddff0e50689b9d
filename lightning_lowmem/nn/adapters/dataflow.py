"""Hand-written LoRA layers, found by their data flow: any module whose forward computes
``linear(x) + scale * B(A(dropout(x)))`` (research code's adapters, torchtune's ``LoRALinear``), whatever its
parts are called and whether ``A`` and ``B`` are linear children or Parameters.

The surgery finds such a forward by tracing it (:mod:`lightning_lowmem.surgery.families.lora`) and rewrites its
``A(dropout(x))`` as :func:`adapter_input`: the adapter's first product saves ``x`` (a memory-sharing norm's
``z`` when ``x`` is its output) and a seed, never a dropped copy. It records what it found on the layer
(:class:`LoRARecord`), which is how this adapter knows the layer afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_lowmem.nn.adapters import LinearAdapter
from lightning_lowmem.nn.linear import shared_linear
from lightning_lowmem.nn.norm import norm_of_output

RECORD = "_lowmem_lora"
"""The layer's attribute holding its :class:`LoRARecord` once its forward is rewritten."""


@dataclass(frozen=True)
class LoRARecord:
    """The Parameters (qualified names in the layer) of a LoRA layer's base weight and of its adapter's ``A``."""

    base: str
    a: str


def adapter_input(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dropout: nn.Module) -> torch.Tensor:
    """``A(dropout(x))`` of a hand-written LoRA layer (``weight`` and ``bias`` are ``A``'s, ``dropout`` its dropout
    module or ``nn.Identity``), with the dropout folded in: it saves ``x`` (or a norm's ``z``) and a seed."""
    p = dropout.p if isinstance(dropout, nn.Dropout) and dropout.training else 0.0
    return shared_linear(x, weight, bias, norm_of_output(x), p)


class HandWrittenLoRA(LinearAdapter):
    name = "hand-written"

    def matches(self, layer: nn.Module) -> bool:
        return isinstance(layer.__dict__.get(RECORD), LoRARecord)

    def saves_its_input(self, layer: nn.Module) -> bool:
        """A trainable base weight saves the input; so does a trainable ``A``, its dropout folded in."""
        record: LoRARecord = layer.__dict__[RECORD]
        return layer.get_parameter(record.base).requires_grad or layer.get_parameter(record.a).requires_grad

    def reads_linearly(self, layer: nn.Module) -> bool:
        return True

    def installed(self, layer: nn.Module) -> bool:
        return True  # the record comes with the rewritten forward


ADAPTER = HandWrittenLoRA()
