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


class _MemorySharingNorm(nn.Module):
    """Shared plumbing of the two norms: shape, eps, ``from_module``, repr."""

    stock: type[nn.Module]

    def __init__(self, normalized_shape: int | Sequence[int], eps: float | None) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps

    @classmethod
    def from_module(cls, module: nn.Module):
        """Build from the matching stock norm without affine parameters."""
        if not isinstance(module, cls.stock):
            raise TypeError(f"{cls.__name__}.from_module expects nn.{cls.stock.__name__}, got {type(module).__name__}")
        _refuse_affine(cls, module)
        return cls(module.normalized_shape, module.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, saves=output+rstd"


class MSLayerNorm(_MemorySharingNorm):
    """Affine-free LayerNorm that shares its saved output with the next linear layer."""

    stock = nn.LayerNorm

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5) -> None:
        super().__init__(normalized_shape, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ms_layer_norm(x, self.normalized_shape, self.eps)


class MSRMSNorm(_MemorySharingNorm):
    """Affine-free RMSNorm that shares its saved output with the next linear layer.

    ``eps=None`` means ``torch.finfo(x.dtype).eps``, as in ``nn.RMSNorm``.
    """

    stock = nn.RMSNorm

    def __init__(self, normalized_shape: int | Sequence[int], eps: float | None = 1e-6) -> None:
        super().__init__(normalized_shape, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return ms_rms_norm(x, self.normalized_shape, eps)
