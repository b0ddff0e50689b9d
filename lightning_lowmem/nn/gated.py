"""Gated MLPs (SwiGLU, GeGLU) whose ``act(gate) * up`` is one low-memory op.

``mode="auto"`` chooses per forward, from the layer that reads the product ``h``: when it saves
``h`` for its own backward (a trainable down projection, or a LoRA adapter reading ``h``
directly), the op saves ``gate`` and shares that ``h`` (``"gate"``: one extra activation);
otherwise it saves ``gate`` and ``up`` (``"gate_up"``: exact, two). See
:mod:`lightning_lowmem.ops.gated`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from lightning_lowmem.ops.gated import ACTIVATIONS, MODES, gated_activation


def saves_its_input(layer: nn.Module | None) -> bool:
    """Whether ``layer`` (an ``nn.Linear`` or a peft LoRA layer over one) saves its input tensor itself.

    A frozen linear saves nothing (its input gradient needs only the weight). A peft LoRA
    ``lora_A`` saves the very input when it trains and its dropout is the identity (peft's input
    cast under autocast copies it instead, which ``apply_lowmem`` turns off).
    """
    if isinstance(layer, nn.Linear):
        return layer.weight.requires_grad
    base, lora_a = getattr(layer, "base_layer", None), getattr(layer, "lora_A", None)
    if not isinstance(base, nn.Linear) or not isinstance(lora_a, nn.ModuleDict):
        return False
    if base.weight.requires_grad:
        return True
    if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
        return False
    dropout = getattr(layer, "lora_dropout", {})
    return any(
        name in lora_a and lora_a[name].weight.requires_grad and isinstance(dropout[name], nn.Identity)
        for name in getattr(layer, "active_adapters", ())
    )


class GatedMLPBase(nn.Module, ABC):
    """``output(act(gate) * up)`` with ``gate, up = gate_and_up(x)``; subclasses fix the layout.

    Subclasses register the projections under the stock model's names (state_dict keys do not
    change) and say which layer reads the product directly (``consumer``), for ``mode="auto"``.
    """

    def __init__(self, activation: str = "silu", mode: str = "auto") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"{type(self).__name__}: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if mode not in ("auto", *MODES):
            raise ValueError(f"{type(self).__name__}: mode must be 'auto', 'gate_up' or 'gate', got {mode!r}")
        self.activation, self.mode = activation, mode

    @abstractmethod
    def gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two projections of the input."""

    @abstractmethod
    def output(self, h: torch.Tensor) -> torch.Tensor:
        """Everything after the product (the down projection, and any dropout or norm)."""

    @abstractmethod
    def consumer(self) -> nn.Module | None:
        """The layer that receives the product itself (``None`` if anything comes in between)."""

    def resolved_mode(self) -> str:
        """``mode``, with ``"auto"`` resolved for the current ``requires_grad`` flags."""
        if self.mode != "auto":
            return self.mode
        return "gate" if saves_its_input(self.consumer()) else "gate_up"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if x.dtype == torch.float32 and torch.is_autocast_enabled(device_type):
            # what autocast does in each projection anyway, once: gate and up (and their LoRA
            # adapters) then save one half-precision copy of x instead of one each
            x = x.to(torch.get_autocast_dtype(device_type))
        gate, up = self.gate_and_up(x)
        return self.output(gated_activation(gate, up, self.activation, self.resolved_mode()))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, mode={self.mode!r}"


class GatedMLP(GatedMLPBase):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: the LLaMA / Mistral / Qwen MLP, same names."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False, mode: str = "auto"
    ) -> None:
        super().__init__(activation, mode)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    @classmethod
    def from_projections(
        cls,
        gate_proj: nn.Module,
        up_proj: nn.Module,
        down_proj: nn.Module,
        activation: str = "silu",
        mode: str = "auto",
    ) -> GatedMLP:
        """Wrap existing projection modules (plain, LoRA-adapted, ...) as they are."""
        new = cls.__new__(cls)
        GatedMLPBase.__init__(new, activation, mode)
        new.gate_proj, new.up_proj, new.down_proj = gate_proj, up_proj, down_proj
        return new

    def gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_proj(x), self.up_proj(x)

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(h)

    def consumer(self) -> nn.Module:
        return self.down_proj
