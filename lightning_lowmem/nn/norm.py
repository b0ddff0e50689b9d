"""Affine-free memory-sharing norm modules over :mod:`lightning_lowmem.ops.norm`.

They hold no parameters: a stock norm's affine ``gamma, beta`` must move to its
consumers first (model surgery does that), so ``from_module`` refuses a norm whose
affine would otherwise be silently dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_lowmem.ops.norm import ms_layer_norm, ms_rms_norm


def _shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


def _refuse_affine(cls: type, module: nn.Module) -> None:
    affine = [name for name, _ in module.named_parameters(recurse=False)]
    if affine:
        raise ValueError(
            f"{cls.__name__}.from_module: {type(module).__name__} has affine parameters {affine}; "
            f"{cls.__name__} is affine-free, so they must be moved into the consumers first "
            "(lightning_lowmem.apply_lowmem does this). Refusing to drop them silently."
        )


class MSLayerNorm(nn.Module):
    """Affine-free LayerNorm that shares its saved output with the next linear layer."""

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps

    @classmethod
    def from_module(cls, module: nn.Module) -> MSLayerNorm:
        """Build from an ``nn.LayerNorm`` without affine parameters."""
        if not isinstance(module, nn.LayerNorm):
            raise TypeError(f"MSLayerNorm.from_module expects nn.LayerNorm, got {type(module).__name__}")
        _refuse_affine(cls, module)
        return cls(module.normalized_shape, module.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ms_layer_norm(x, self.normalized_shape, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, saves=output+rstd"


class MSRMSNorm(nn.Module):
    """Affine-free RMSNorm that shares its saved output with the next linear layer.

    ``eps=None`` means ``torch.finfo(x.dtype).eps``, as in ``nn.RMSNorm``.
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float | None = 1e-6) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps

    @classmethod
    def from_module(cls, module: nn.Module) -> MSRMSNorm:
        """Build from an ``nn.RMSNorm`` without affine parameters."""
        if not isinstance(module, nn.RMSNorm):
            raise TypeError(f"MSRMSNorm.from_module expects nn.RMSNorm, got {type(module).__name__}")
        _refuse_affine(cls, module)
        return cls(module.normalized_shape, module.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return ms_rms_norm(x, self.normalized_shape, eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, saves=output+rstd"
