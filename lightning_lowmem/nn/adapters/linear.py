"""The plain linear layer: ``nn.Linear`` and its subclasses that compute the same (Falcon's ``FalconLinear``, our
:class:`~lightning_lowmem.nn.LowMemLinear`)."""

from __future__ import annotations

from torch import nn

from lightning_lowmem.nn.adapters import LinearAdapter, not_a_linear_head


class PlainLinear(LinearAdapter):
    name = "torch"
    generic = True

    def matches(self, layer: nn.Module) -> bool:
        return isinstance(layer, nn.Linear)

    def saves_its_input(self, layer: nn.Module) -> bool:
        """A frozen linear saves nothing (its input gradient needs only the weight)."""
        return layer.weight.requires_grad

    def head_refusal(self, layer: nn.Module) -> str | None:
        return not_a_linear_head(layer)


ADAPTER = PlainLinear()
