"""What lightning-lowmem knows about peft's LoRA layers, in one place.

peft is never imported: its layers are recognised by what they hold (a ``base_layer`` and a
``lora_A`` ``ModuleDict`` of linears, ``lora_dropout`` per adapter, ``active_adapters``).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from lightning_lowmem.nn import litgpt


def is_lora_layer(module: nn.Module) -> bool:
    """A peft LoRA layer: a base layer with ``lora_A`` adapters around it."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and isinstance(
        getattr(module, "lora_A", None), nn.ModuleDict
    )


def active_adapters(layer: nn.Module) -> list[str]:
    """The adapters a LoRA ``layer`` adds now (none when disabled or merged into the base weight)."""
    if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
        return []
    return [name for name in getattr(layer, "active_adapters", ()) if name in layer.lora_A]


def lora_dropouts(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
    """``(layer name, LoRA layer, adapter, dropout module)`` for every adapter's dropout of ``model``'s LoRA layers
    (``nn.Identity`` for ``lora_dropout=0``)."""
    for name, module in model.named_modules():
        if is_lora_layer(module):
            for adapter, dropout in getattr(module, "lora_dropout", {}).items():
                yield name, module, adapter, dropout


def uses_dora(layer: nn.Module, adapter: str) -> bool:
    """Whether ``adapter`` of the LoRA ``layer`` is DoRA (its forward reads the dropped input itself)."""
    return bool(getattr(layer, "use_dora", {}).get(adapter)) or adapter in getattr(layer, "lora_variant", {})


def saves_its_input(layer: nn.Module | None) -> bool:
    """Whether ``layer`` (an ``nn.Linear``, or a peft or LitGPT LoRA layer over one) saves its input tensor itself.

    A frozen linear saves nothing (its input gradient needs only the weight). A LoRA ``lora_A``
    saves the very input when it trains and its dropout is the identity (peft's input cast under
    autocast copies it instead, which :func:`redundant_input_casts` finds).
    """
    if isinstance(layer, nn.Linear):
        return layer.weight.requires_grad
    if layer is not None and litgpt.is_lora_layer(layer):
        return litgpt.saves_its_input(layer)
    if layer is None or not is_lora_layer(layer) or not isinstance(layer.base_layer, nn.Linear):
        return False
    if layer.base_layer.weight.requires_grad:
        return True
    dropout = getattr(layer, "lora_dropout", {})
    return any(
        layer.lora_A[name].weight.requires_grad and isinstance(dropout[name], nn.Identity)
        for name in active_adapters(layer)
    )


def redundant_input_casts(model: nn.Module, casts_itself: type[nn.Module]) -> Iterator[nn.Module]:
    """LoRA layers whose input cast to the adapter dtype only adds a copy (which ``lora_A`` saves):
    every ``lora_A`` is a ``casts_itself`` module, which casts its input itself. Switch their
    ``cast_input_dtype_enabled`` off."""
    for module in model.modules():
        if (
            is_lora_layer(module)
            and getattr(module, "cast_input_dtype_enabled", False) is True
            and len(module.lora_A) > 0
            and all(isinstance(m, casts_itself) for m in module.lora_A.values())
        ):
            yield module
