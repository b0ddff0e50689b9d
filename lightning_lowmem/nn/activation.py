"""Activation modules over :mod:`lightning_lowmem.ops.activation`: exact forward, k-bit backward.

:class:`LowMemActivation` serves every activation of the registry
(:mod:`lightning_lowmem.registry.activations`); :class:`ReGELU2` and :class:`ReSiLU2` are the
paper's names for GELU and SiLU. :meth:`LowMemActivation.create` picks the public class for a name.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_lowmem.ops.activation import regelu2, resilu2, step_activation
from lightning_lowmem.registry.activations import check_bits, code_bits, get_activation


class LowMemActivation(nn.Module):
    """``activation`` with a ``bits``-bit approximate backward (default 2: saves 0.25 byte per element).

    Args:
        activation: a name of the activation registry (``"gelu"``, ``"gelu_tanh"``, ``"silu"``, ``"quick_gelu"``,
            ``"mish"``); the forward is its stock function, bit for bit.
        bits: 1, 2, 3 or 4 bits per element saved for backward (``bits/8`` byte; 3 is stored as 4).
    """

    def __init__(self, activation: str = "gelu", bits: int = 2) -> None:
        super().__init__()
        self.activation = get_activation(activation, type(self).__name__).name
        self.bits = check_bits(type(self).__name__, bits)

    @staticmethod
    def create(activation: str, bits: int = 2) -> LowMemActivation:
        """The module for ``activation``: ReGELU2 (erf or tanh), ReSiLU2, or a LowMemActivation."""
        if activation in ("gelu", "gelu_tanh"):
            return ReGELU2("tanh" if activation == "gelu_tanh" else "none", bits)
        if activation == "silu":
            return ReSiLU2(bits)
        return LowMemActivation(activation, bits)

    @property
    def label(self) -> str:
        """E.g. ``ReGELU2 (tanh), 4-bit``: what the report says it became."""
        return self._name() + ("" if self.bits == 2 else f", {self.bits}-bit")

    def _name(self) -> str:
        return f"{type(self).__name__} ({get_activation(self.activation).label})"

    def _backward_repr(self) -> str:
        stored = code_bits(self.bits)
        return f"backward={self.bits}-bit" + ("" if stored == self.bits else f" (stored in {stored} bits)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return step_activation(x, self.activation, self.bits)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, {self._backward_repr()}"


class ReGELU2(LowMemActivation):
    """GELU (erf, or tanh with ``approximate="tanh"``) with a ``bits``-bit approximate backward.

    Args:
        approximate: ``"none"`` (erf) or ``"tanh"``, as ``nn.GELU``'s.
        bits: bits per element saved for backward (2: the paper's constants).
    """

    def __init__(self, approximate: str = "none", bits: int = 2) -> None:
        if approximate not in ("none", "tanh"):
            raise ValueError(f"ReGELU2: approximate must be 'none' or 'tanh', got {approximate!r}")
        super().__init__("gelu_tanh" if approximate == "tanh" else "gelu", bits)
        self.approximate = approximate

    @classmethod
    def from_module(cls, module: nn.Module, bits: int = 2) -> ReGELU2:
        """Build from an ``nn.GELU`` (its erf or tanh form is kept)."""
        if not isinstance(module, nn.GELU):
            raise TypeError(f"ReGELU2.from_module expects nn.GELU, got {type(module).__name__}")
        return cls(approximate=module.approximate, bits=bits)

    def _name(self) -> str:
        return f"ReGELU2 ({'tanh' if self.approximate == 'tanh' else 'erf'})"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return regelu2(x, approximate=self.approximate, bits=self.bits)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, {self._backward_repr()}"


class ReSiLU2(LowMemActivation):
    """SiLU with a ``bits``-bit approximate backward.

    Args:
        bits: bits per element saved for backward (2: the paper's constants).
    """

    def __init__(self, bits: int = 2) -> None:
        super().__init__("silu", bits)

    @classmethod
    def from_module(cls, module: nn.Module, bits: int = 2) -> ReSiLU2:
        """Build from an ``nn.SiLU`` (``inplace`` is irrelevant: nothing large is saved)."""
        if not isinstance(module, nn.SiLU):
            raise TypeError(f"ReSiLU2.from_module expects nn.SiLU, got {type(module).__name__}")
        return cls(bits=bits)

    def _name(self) -> str:
        return "ReSiLU2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return resilu2(x, bits=self.bits)

    def extra_repr(self) -> str:
        return self._backward_repr()
