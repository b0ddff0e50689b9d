"""peft's LoRA layers (``peft.tuners.lora.Linear`` and its kin): a ``base_layer`` and ``lora_A`` / ``lora_B``
``ModuleDict``s of linears per adapter, ``lora_dropout`` per adapter, ``active_adapters``.

Their adapters are linear children called on the (dropped) input, so the surgery converts those children like any
linear layer; what is peft's own: each adapter's dropout folds into its ``lora_A`` (not DoRA's, whose forward
reads the dropped input itself), the input cast to the adapter dtype is switched off once every ``lora_A`` casts
itself, and a LoRA-adapted language-model head gives the fused loss its adapter term.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_lowmem.nn.adapters import Fold, LinearAdapter, not_a_linear_head
from lightning_lowmem.nn.linear import LowMemLinear
from lightning_lowmem.registry.dropouts import is_elementwise_dropout


def active_adapters(layer: nn.Module) -> list[str]:
    """The adapters a LoRA ``layer`` adds now (none when disabled or merged into the base weight)."""
    if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
        return []
    return [name for name in getattr(layer, "active_adapters", ()) if name in layer.lora_A]


def uses_dora(layer: nn.Module, adapter: str) -> bool:
    """Whether ``adapter`` of the LoRA ``layer`` is DoRA (its forward reads the dropped input itself)."""
    return bool(getattr(layer, "use_dora", {}).get(adapter)) or adapter in getattr(layer, "lora_variant", {})


class PeftLoRA(LinearAdapter):
    name = "peft"

    def matches(self, layer: nn.Module) -> bool:
        return isinstance(getattr(layer, "base_layer", None), nn.Module) and isinstance(
            getattr(layer, "lora_A", None), nn.ModuleDict
        )

    def saves_its_input(self, layer: nn.Module) -> bool:
        """A trainable linear base layer, or a trainable ``lora_A`` whose dropout is the identity (peft's input cast
        under autocast copies it instead, which :meth:`after_conversion` switches off)."""
        if not isinstance(layer.base_layer, nn.Linear):
            return False
        if layer.base_layer.weight.requires_grad:
            return True
        dropout = getattr(layer, "lora_dropout", {})
        return any(
            layer.lora_A[name].weight.requires_grad and isinstance(dropout[name], nn.Identity)
            for name in active_adapters(layer)
        )

    def folds(self, layer: nn.Module) -> Iterator[Fold]:
        """Each adapter's dropout into its ``lora_A`` (``nn.Identity`` at ``lora_dropout=0``: nothing to fold)."""
        for adapter, dropout in getattr(layer, "lora_dropout", {}).items():
            if not is_elementwise_dropout(dropout) or dropout.p == 0:
                continue
            name, into = f"lora_dropout.{adapter}", f"lora_A.{adapter}"
            if uses_dora(layer, adapter):
                yield Fold(name, into, dropout.p, refused="a DoRA adapter: its forward reads the dropped input itself")
            else:
                yield Fold(name, into, dropout.p)

    def passes_casts(self, layer: nn.Module) -> bool:
        return True  # its cast of the input to the adapter dtype, switched off by after_conversion

    def after_conversion(self, layer: nn.Module, replaced: dict[nn.Module, nn.Module]) -> dict[str, object]:
        """The input cast to the adapter dtype only adds a copy (which ``lora_A`` saves) once every ``lora_A`` is a
        :class:`~lightning_lowmem.nn.LowMemLinear`, which casts its input itself: off."""
        new = [replaced.get(a, a) for a in layer.lora_A.values()]
        if (
            getattr(layer, "cast_input_dtype_enabled", False) is True
            and new
            and all(isinstance(a, LowMemLinear) for a in new)
        ):
            return {"cast_input_dtype_enabled": False}
        return {}

    def head_refusal(self, layer: nn.Module) -> str | None:
        if len(active_adapters(layer)) > 1 or any(uses_dora(layer, adapter) for adapter in layer.lora_A):
            return "its head has several active LoRA adapters or DoRA (kept stock, with its logits)"
        if any(b.bias is not None for b in layer.lora_B.values()):
            return "its head's LoRA adapter has a bias (kept stock, with its logits)"
        return not_a_linear_head(layer.base_layer)

    def head_operands(self, layer: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """The base weight and bias and the adapter's term ``(scaling * lora_A(dropout(hidden)), lora_B.weight)``,
        computed as peft computes it."""
        base, active = layer.base_layer, active_adapters(layer)
        if len(active) > 1:
            raise RuntimeError(f"the fused loss takes one LoRA adapter on the head; {active} are active")
        if not active:
            return base.weight, base.bias, None
        lora_a = layer.lora_A[active[0]]
        inputs = layer.lora_dropout[active[0]](layer._cast_input_dtype(hidden, lora_a.weight.dtype))
        return base.weight, base.bias, (lora_a(inputs) * layer.scaling[active[0]], layer.lora_B[active[0]].weight)


ADAPTER = PeftLoRA()
