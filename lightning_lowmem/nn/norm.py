"""Memory-sharing norm modules (MS-LN, MS-RMSNorm) over :mod:`lightning_lowmem.ops.norm`.

A memory-sharing norm returns its affine-free output ``z``: that is the tensor it saves, and the
very tensor its consumer linears save. Its affine ``gamma * z + beta`` therefore happens inside
the consumers: the norm keeps ``weight`` / ``bias`` under their stock names (checkpoints load
into the stock model and back) and each consumer is a
:class:`~lightning_lowmem.nn.LowMemLinear` built with ``norm=`` this module, which applies them
and counts itself in :attr:`consumers`. A norm with an affine but no consumer refuses to run
rather than silently drop it. Model surgery builds exactly these modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_lowmem.ops.norm import ms_layer_norm, ms_rms_norm


class MemorySharingNorm(nn.Module):
    """Shared plumbing of the two norms: shape, eps, the deferred affine, ``from_module``, repr."""

    stock: type[nn.Module]  # the torch module ``from_module`` takes
    op: Callable[..., torch.Tensor]  # the functional op

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None,
        weight: nn.Parameter | None = None,
        bias: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.normalized_shape, self.eps = shape, eps
        self.weight, self.bias = weight, bias
        self.consumers = 0  # LowMemLinear layers that apply the affine

    @classmethod
    def from_module(cls, module: nn.Module, defer_affine: bool = False):
        """Build from the matching stock norm, keeping its own Parameter objects.

        A norm with an affine needs ``defer_affine=True`` and then consumers that apply it
        (``LowMemLinear.from_linear(linear, norm=new)``); otherwise it is refused.
        """
        if not isinstance(module, cls.stock):
            raise TypeError(f"{cls.__name__}.from_module expects nn.{cls.stock.__name__}, got {type(module).__name__}")
        weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
        if (weight is not None or bias is not None) and not defer_affine:
            affine = [name for name, p in (("weight", weight), ("bias", bias)) if p is not None]
            raise ValueError(
                f"{cls.__name__}.from_module: {type(module).__name__} has affine parameters {affine}; a memory-sharing "
                "norm returns its affine-free output, so its consumers must apply them: pass defer_affine=True and "
                "build each consumer with LowMemLinear.from_linear(linear, norm=...) (lightning_lowmem.apply_lowmem "
                "does both). Refusing to drop them silently."
            )
        new = cls(module.normalized_shape, module.eps)
        new.weight, new.bias = weight, bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.weight is not None or self.bias is not None) and not self.consumers:
            raise RuntimeError(
                f"{type(self).__name__} has an affine but no LowMemLinear consumer applies it; build its consumers "
                "with LowMemLinear.from_linear(linear, norm=this_norm)"
            )
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return self.op(x, self.normalized_shape, eps)

    def extra_repr(self) -> str:
        has_affine = self.weight is not None or self.bias is not None
        affine = f", affine applied by {self.consumers} consumers" if has_affine else ""
        return f"{self.normalized_shape}, eps={self.eps}, saves=output+rstd{affine}"


class MSLayerNorm(MemorySharingNorm):
    """LayerNorm that returns (and saves) its affine-free output, shared with the next linear layers."""

    stock = nn.LayerNorm
    op = staticmethod(ms_layer_norm)

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        weight: nn.Parameter | None = None,
        bias: nn.Parameter | None = None,
    ) -> None:
        super().__init__(normalized_shape, eps, weight, bias)


class MSRMSNorm(MemorySharingNorm):
    """RMSNorm that returns (and saves) its affine-free output, shared with the next linear layers.

    ``eps=None`` means ``torch.finfo(x.dtype).eps``, as in ``nn.RMSNorm``.
    """

    stock = nn.RMSNorm
    op = staticmethod(ms_rms_norm)

    def __init__(
        self, normalized_shape: int | Sequence[int], eps: float | None = 1e-6, weight: nn.Parameter | None = None
    ) -> None:
        super().__init__(normalized_shape, eps, weight, None)
