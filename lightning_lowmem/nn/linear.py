"""``LowMemLinear``: an ``nn.Linear`` (same parameters, same state_dict keys) that saves less.

With ``norm`` set, it is a consumer of that memory-sharing norm: when its input is the norm's
output it saves the norm's ``z`` instead of the input (:func:`~lightning_lowmem.ops.affine_linear`);
any other input is an ordinary linear call. Under autocast it recasts its weight from the
parameter in backward instead of saving a half-precision copy. Outside autocast it casts an
input of another dtype to its weight's, as a peft LoRA layer's input cast would (surgery turns
that copy off, see :func:`~lightning_lowmem.nn.peft.redundant_input_casts`), saving a narrower
input as it is (fp32 adapters on a bf16 model share the bf16 tensor other layers save).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem.nn.norm import MemorySharingNorm, shared_from
from lightning_lowmem.ops.affine import affine_linear
from lightning_lowmem.ops.autocast import autocast_dtype


class LowMemLinear(nn.Linear):
    """An ``nn.Linear`` that shares its input norm's saved tensor and never saves a weight copy."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, norm: MemorySharingNorm | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device="meta")
        # not a submodule: the norm is registered where it lives, and its parameters must not
        # appear twice in state_dict() / parameters()
        self.__dict__["norm"] = norm

    @classmethod
    def from_linear(cls, linear: nn.Linear, norm: MemorySharingNorm | None = None) -> LowMemLinear:
        """Wrap ``linear``'s own Parameter objects (optimizers and peft keep working)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, norm=norm)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = None if self.norm is None else shared_from(x, self.norm)
        compute = autocast_dtype(x.device.type) if self.weight.is_floating_point() else None
        if z is None and compute is None and x.dtype == self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        gamma, beta = (None, None) if z is None else (self.norm.weight, self.norm.bias)
        return affine_linear(x, self.weight, self.bias, compute or self.weight.dtype, z, gamma, beta)

    def extra_repr(self) -> str:
        shares = ", saves its input norm's normalized output" if self.norm is not None else ""
        return f"{super().extra_repr()}, recasts weight in backward{shares}"
