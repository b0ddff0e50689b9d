"""``LowMemLinear``: an ``nn.Linear`` (same parameters, same state_dict keys) that saves less.

It is the consumer side of a memory-sharing norm: with ``norm`` set, its input is that norm's
affine-free output ``z`` and it computes ``linear(norm.weight * z + norm.bias)``, saving only
``z`` (:func:`~lightning_lowmem.ops.linear.affine_linear`). Under autocast it also recasts its
weight from the parameter in backward instead of saving a half-precision copy. Outside
autocast and without a norm it is exactly ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem.nn.norm import MemorySharingNorm
from lightning_lowmem.ops.autocast import autocast_dtype
from lightning_lowmem.ops.linear import affine_linear


class LowMemLinear(nn.Linear):
    """An ``nn.Linear`` that applies its input norm's affine and never saves a weight copy."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, norm: MemorySharingNorm | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device="meta")
        # not a submodule: the norm is registered where it lives, and its parameters must not
        # appear twice in state_dict() / parameters()
        self.__dict__["norm"] = norm
        if norm is not None:
            norm.consumers += 1

    @classmethod
    def from_linear(cls, linear: nn.Linear, norm: MemorySharingNorm | None = None) -> LowMemLinear:
        """Wrap ``linear``'s own Parameter objects (optimizers and peft keep working)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, norm=norm)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = beta = None
        if self.norm is not None:
            gamma, beta = self.norm.weight, self.norm.bias
        compute = autocast_dtype(x.device.type) if self.weight.is_floating_point() else None
        if self.norm is None and compute is None:
            return F.linear(x, self.weight, self.bias)
        return affine_linear(x, self.weight, self.bias, gamma, beta, compute or self.weight.dtype)

    def extra_repr(self) -> str:
        applies = ", applies the affine of its input norm" if self.norm is not None else ""
        return f"{super().extra_repr()}, recasts weight in backward{applies}"
