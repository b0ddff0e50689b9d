"""Activation modules over :mod:`lightning_lowmem.ops.activation`."""

from __future__ import annotations

import torch
from torch import nn

from lightning_lowmem.ops.activation import regelu2, resilu2


class ReGELU2(nn.Module):
    """GELU with a 2-bit approximate backward (saves 0.25 byte per element)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"ReGELU2: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    @classmethod
    def from_module(cls, module: nn.Module) -> ReGELU2:
        """Build from an ``nn.GELU`` (its erf or tanh form is kept)."""
        if not isinstance(module, nn.GELU):
            raise TypeError(f"ReGELU2.from_module expects nn.GELU, got {type(module).__name__}")
        return cls(approximate=module.approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return regelu2(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, backward=2-bit"


class ReSiLU2(nn.Module):
    """SiLU with a 2-bit approximate backward (saves 0.25 byte per element)."""

    @classmethod
    def from_module(cls, module: nn.Module) -> ReSiLU2:
        """Build from an ``nn.SiLU`` (``inplace`` is irrelevant: nothing large is saved)."""
        if not isinstance(module, nn.SiLU):
            raise TypeError(f"ReSiLU2.from_module expects nn.SiLU, got {type(module).__name__}")
        return cls()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return resilu2(x)

    def extra_repr(self) -> str:
        return "backward=2-bit"
