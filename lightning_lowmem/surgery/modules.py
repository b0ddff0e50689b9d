"""The modules model surgery puts in: a norm whose affine moved to its consumer linears, and
gated MLPs with the fused low-memory product.

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

from lightning_lowmem.nn.gated import GatedMLP, GatedMLPBase
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
        _, needs_w, _, needs_gamma, _, _ = ctx.needs_input_grad
        # only the weight and gamma gradients read the input: a frozen linear saves none, as stock
        ctx.save_for_backward(shared if needs_w or needs_gamma else None, weight, gamma, beta)
        ctx.dtype, ctx.z_dtype, ctx.has_bias = dtype, z.dtype, bias is not None
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
                grad_z = grad_z.to(ctx.z_dtype)
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


class TimmGluMlp(GatedMLPBase):
    """timm's ``SwiGLU`` (``fc1_g``, ``fc1_x``) or ``GluMlp`` (one ``fc1`` whose halves are gate and
    up) with the fused product; children keep their names, so state_dict keys do not change."""

    def __init__(self, stock: nn.Module, activation: str, mode: str = "auto") -> None:
        super().__init__(activation, mode)
        self.packed = "fc1" in stock._modules
        self.gate_last = bool(getattr(stock, "gate_last", False))
        for name in ("fc1",) if self.packed else ("fc1_g", "fc1_x"):
            self.add_module(name, stock._modules[name])
        for name in ("drop1", "norm", "fc2", "drop2"):
            self.add_module(name, stock._modules[name])

    def gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.packed:
            return self.fc1_g(x), self.fc1_x(x)
        first, second = self.fc1(x).chunk(2, dim=-1)
        return (second, first) if self.gate_last else (first, second)

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(h))))

    def consumer(self) -> nn.Module | None:
        passes_through = isinstance(self.drop1, nn.Identity) or getattr(self.drop1, "p", None) == 0
        return self.fc2 if passes_through and isinstance(self.norm, nn.Identity) else None


def fused_gated_mlp(stock: nn.Module, layout: str, activation: str) -> GatedMLPBase:
    """The fused replacement of a stock gated MLP of ``layout`` (``"hf"`` or ``"timm"``), sharing its children."""
    if layout == "hf":
        return GatedMLP.from_projections(stock.gate_proj, stock.up_proj, stock.down_proj, activation)
    return TimmGluMlp(stock, activation)
