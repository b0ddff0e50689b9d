"""Linear-like layers, one module per library: what each layer reads, whether it saves its input, where its
dropout folds, and how its forward is replaced.

A layer the surgery meets is a plain linear layer, a LoRA layer of some library around one, or a quantized
one. Each library's knowledge lives in one module of this package and nowhere else (:mod:`.peft`,
:mod:`.litgpt`, :mod:`.bitsandbytes`, hand-written LoRA found by its data flow in :mod:`.dataflow`, and the
plain :mod:`.linear`); each module defines ``ADAPTER``, a :class:`LinearAdapter`, and is found here by
itself: adding a library is adding its module. The libraries are never imported: their layers are
recognised by what they hold.
"""

from __future__ import annotations

import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import import_module
from typing import Any, ClassVar

import torch
from torch import nn


@dataclass(frozen=True)
class Fold:
    """A dropout of an adapter that moves into the linear computation reading its output, which then saves its
    input (or a norm's ``z``) and a seed instead of the dropped copy. ``dropout`` and ``into`` are names relative
    to the layer: ``into`` is a linear child (replaced by one taking the dropout in) or, with ``by_forward``, what
    the layer's installed forward multiplies (:meth:`LinearAdapter.forward`); ``refused`` says why it cannot fold
    (it then stays, and a norm read through it is not shared)."""

    dropout: str
    into: str
    p: float
    by_forward: bool = False
    refused: str | None = None


class LinearAdapter(ABC):
    """One library's linear-like layers. Every method takes a layer :meth:`matches` accepted."""

    name: ClassVar[str]  # the library, for the report
    generic: ClassVar[bool] = False  # the plain linear layer: asked last

    @abstractmethod
    def matches(self, layer: nn.Module) -> bool:
        """Whether ``layer`` is one of this library's."""

    @abstractmethod
    def saves_its_input(self, layer: nn.Module) -> bool:
        """Whether the layer saves its very input tensor for backward (a gated product read by it then shares)."""

    def reads_linearly(self, layer: nn.Module) -> bool:
        """Whether the layer, called on a memory-sharing norm's output, shares it as a whole (its installed
        forward does, or it saves nothing): the norm counts it as one of its consumers. Layers whose linear
        children are called on the input are found through those children instead."""
        return False

    def folds(self, layer: nn.Module) -> Iterator[Fold]:
        """The dropouts of the layer's adapters, each with where it folds or why it cannot."""
        return iter(())

    def installed(self, layer: nn.Module) -> bool:
        """Whether an earlier run converted the layer (it runs the forward the surgery installed)."""
        return False

    def passes_casts(self, layer: nn.Module) -> bool:
        """Whether a cast of the input inside the layer is one the surgery switches off (the probe then follows the
        norm's output through it)."""
        return False

    def after_conversion(self, layer: nn.Module, replaced: dict[nn.Module, nn.Module]) -> dict[str, object]:
        """Attributes of the layer to set once its children are ``replaced`` (old -> new)."""
        return {}

    def head_operands(self, layer: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """``(weight, bias, lora)`` of the layer as a language-model head, for the fused linear + cross-entropy."""
        return linear_head_operands(layer)

    def head_refusal(self, layer: nn.Module) -> str | None:
        """Why the fused loss cannot take the layer as a head (``None``: it can, by :meth:`head_operands`)."""
        return f"its head is a {type(layer).__name__}, not a linear layer (kept stock, with its logits)"


class ForwardAdapter(LinearAdapter):
    """A library whose layers compute their adapter with Parameters in their own forward (LitGPT's): the surgery
    installs :meth:`forward` on them."""

    @abstractmethod
    def forward(self, layer: nn.Module, norm: nn.Module | None, dropout: float) -> Callable[..., Any]:
        """The forward to install on the layer so that it shares ``norm``'s ``z`` and takes in a folded dropout of
        probability ``dropout``."""


def linear_head_operands(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """A head that is a linear layer (its own or a tied weight, an optional bias), as the fused loss takes it."""
    return layer.weight, getattr(layer, "bias", None), None


def not_a_linear_head(layer: nn.Module) -> str | None:
    """Why ``layer`` is no head the fused loss computes as ``F.linear`` (a floating 2-d weight, an optional bias
    and nothing else), or ``None``."""
    params = dict(layer.named_parameters())
    weight = params.get("weight")
    if set(params) - {"weight", "bias"} or weight is None or weight.dim() != 2 or not weight.is_floating_point():
        return f"its head is a {type(layer).__name__}, not a linear layer (kept stock, with its logits)"
    return None


def _discover() -> tuple[LinearAdapter, ...]:
    adapters = [import_module(f"{__name__}.{info.name}").ADAPTER for info in pkgutil.iter_modules(__path__)]
    return tuple(sorted(adapters, key=lambda adapter: adapter.generic))


ADAPTERS: tuple[LinearAdapter, ...] = _discover()
"""Every library's adapter, the plain linear layer last."""


def adapter_of(layer: nn.Module | None) -> LinearAdapter | None:
    """The adapter of the library ``layer`` belongs to, if any."""
    if layer is None:
        return None
    return next((adapter for adapter in ADAPTERS if adapter.matches(layer)), None)


def saves_its_input(layer: nn.Module | None) -> bool:
    """Whether ``layer`` (any library's linear-like layer) saves its very input tensor for backward."""
    adapter = adapter_of(layer)
    return adapter is not None and adapter.saves_its_input(layer)
