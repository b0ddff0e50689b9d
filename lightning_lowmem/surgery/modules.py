"""The modules model surgery puts in: a norm whose affine moved to its consumer linears.

A memory-sharing norm must return its affine-free output ``z`` (that is the tensor it saves),
so the affine ``gamma * z + beta`` has to happen inside the consumers. :class:`DeferredAffineNorm`
keeps ``weight`` / ``bias`` under their original names (state_dict keys do not change) and
:class:`LowMemLinear` applies them: ``linear(gamma * z + beta)``, saving only ``z`` (the very
tensor the norm saved) and recomputing the affine in backward. Under autocast it also recasts
its weight from the parameter in backward instead of saving a half-precision copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem.ops.norm import ms_layer_norm, ms_rms_norm


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type) and weight.is_floating_point():
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _affine(z: torch.Tensor, gamma: torch.Tensor | None, beta: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``gamma * z + beta`` in the parameters' precision, returned in ``dtype``."""
    if gamma is None and beta is None:
        return z.to(dtype)
    param = gamma if gamma is not None else beta
    out = z.to(param.dtype)
    if gamma is not None:
        out = out * gamma
    if beta is not None:
        out = out + beta
    return out.to(dtype)


class AffineLinearFunction(torch.autograd.Function):
    """``linear(gamma * z + beta, W, b)`` saving ``z`` and parameters only.

    Parameters (``W``, ``b``, ``gamma``, ``beta``) are saved as they are, full precision, and cast
    to the compute dtype again in backward, so nothing but ``z`` counts as activation memory.
    Without an affine the input is saved in the compute dtype, as a stock linear would.
    """

    @staticmethod
    def forward(ctx, z, weight, bias, gamma, beta, dtype: torch.dtype):
        with torch.autocast(z.device.type, enabled=False):
            x = _affine(z, gamma, beta, dtype)
            out = F.linear(x, weight.to(dtype), None if bias is None else bias.to(dtype))
        shared = z if gamma is not None or beta is not None else x
        ctx.save_for_backward(shared, weight, gamma, beta)
        ctx.dtype, ctx.has_bias = dtype, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        z, weight, gamma, beta = ctx.saved_tensors
        needs_z, needs_w, needs_b, needs_gamma, needs_beta, _ = ctx.needs_input_grad
        dtype = ctx.dtype
        grad = grad.to(dtype)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_z = grad_w = grad_b = grad_gamma = grad_beta = None
        if needs_w:
            x = _affine(z, gamma, beta, dtype)
            grad_w = (grad_2d.t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
        if needs_b:
            grad_b = grad_2d.sum(0).to(weight.dtype)
        if needs_z or needs_gamma or needs_beta:
            grad_x = grad @ weight.to(dtype)
            if needs_gamma:
                rows = grad_x.reshape(-1, *gamma.shape).to(gamma.dtype) * z.reshape(-1, *gamma.shape).to(gamma.dtype)
                grad_gamma = rows.sum(0)
            if needs_beta:
                grad_beta = grad_x.reshape(-1, *beta.shape).to(beta.dtype).sum(0)
            if needs_z:
                grad_z = grad_x if gamma is None else grad_x.to(gamma.dtype) * gamma
                grad_z = grad_z.to(z.dtype)
        return grad_z, grad_w, grad_b, grad_gamma, grad_beta, None


class LowMemLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state_dict keys) that saves less for backward.

    With ``norm`` set, its input is that norm's affine-free output ``z`` and it computes
    ``linear(norm.weight * z + norm.bias)``. Under autocast it never saves a cast weight copy.
    Outside autocast and without a norm it is exactly ``F.linear``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, norm: nn.Module | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device="meta")
        # not a submodule: the norm is registered where it lives, and its parameters must not
        # appear twice in state_dict() / parameters()
        self.__dict__["norm"] = norm

    @classmethod
    def from_linear(cls, linear: nn.Linear, norm: nn.Module | None = None) -> LowMemLinear:
        """Wrap ``linear``'s own Parameter objects (optimizers and peft keep working)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, norm=norm)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = beta = None
        if self.norm is not None:
            gamma, beta = self.norm.weight, self.norm.bias
        elif not torch.is_autocast_enabled(x.device.type):
            return F.linear(x, self.weight, self.bias)
        return AffineLinearFunction.apply(x, self.weight, self.bias, gamma, beta, _compute_dtype(x, self.weight))

    def extra_repr(self) -> str:
        applies = ", applies the affine of its input norm" if self.norm is not None else ""
        return f"{super().extra_repr()}, recasts weight in backward{applies}"


class DeferredAffineNorm(nn.Module):
    """A memory-sharing LayerNorm / RMSNorm whose affine its consumers apply.

    ``forward`` returns the affine-free ``z``; ``weight`` / ``bias`` stay here under their
    original names (so checkpoints load into the stock model) and every consumer is a
    :class:`LowMemLinear` pointing back at this module. Only model surgery creates it, after
    checking that nothing but those linears reads the output.
    """

    def __init__(
        self,
        kind: str,
        normalized_shape: Sequence[int],
        eps: float | None,
        weight: nn.Parameter | None,
        bias: nn.Parameter | None,
        source: str,
    ) -> None:
        super().__init__()
        if kind not in ("layer", "rms"):
            raise ValueError(f"DeferredAffineNorm: kind must be 'layer' or 'rms', got {kind!r}")
        self.kind, self.normalized_shape, self.eps, self.source = kind, tuple(normalized_shape), eps, source
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            return ms_layer_norm(x, self.normalized_shape, self.eps)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return ms_rms_norm(x, self.normalized_shape, eps)

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.normalized_shape}, eps={self.eps}, from={self.source}, affine applied by consumers"
