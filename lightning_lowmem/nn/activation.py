"""Activation modules over :mod:`lightning_lowmem.ops.activation`."""

from __future__ import annotations

import torch
from torch import nn

from lightning_lowmem.ops.activation import regelu2, resilu2
from lightning_lowmem.ops.constants import SUPPORTED_BITS, storage_bits


def _check_bits(name: str, bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{name}: bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return bits


def _backward_repr(bits: int) -> str:
    stored = storage_bits(bits)
    return f"backward={bits}-bit" + ("" if stored == bits else f" (stored in {stored} bits)")


class ReGELU2(nn.Module):
    """GELU with a ``bits``-bit approximate backward (default 2: saves 0.25 byte per element).

    ``bits`` = 1, 2, 3 or 4 saves ``bits/8`` byte per element (3 is stored as 4).
    """

    def __init__(self, approximate: str = "none", bits: int = 2) -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"ReGELU2: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate
        self.bits = _check_bits("ReGELU2", bits)

    @classmethod
    def from_module(cls, module: nn.Module, bits: int = 2) -> ReGELU2:
        """Build from an ``nn.GELU`` (its erf or tanh form is kept)."""
        if not isinstance(module, nn.GELU):
            raise TypeError(f"ReGELU2.from_module expects nn.GELU, got {type(module).__name__}")
        return cls(approximate=module.approximate, bits=bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return regelu2(x, approximate=self.approximate, bits=self.bits)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, {_backward_repr(self.bits)}"


class ReSiLU2(nn.Module):
    """SiLU with a ``bits``-bit approximate backward (default 2: saves 0.25 byte per element)."""

    def __init__(self, bits: int = 2) -> None:
        super().__init__()
        self.bits = _check_bits("ReSiLU2", bits)

    @classmethod
    def from_module(cls, module: nn.Module, bits: int = 2) -> ReSiLU2:
        """Build from an ``nn.SiLU`` (``inplace`` is irrelevant: nothing large is saved)."""
        if not isinstance(module, nn.SiLU):
            raise TypeError(f"ReSiLU2.from_module expects nn.SiLU, got {type(module).__name__}")
        return cls(bits=bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return resilu2(x, bits=self.bits)

    def extra_repr(self) -> str:
        return _backward_repr(self.bits)
