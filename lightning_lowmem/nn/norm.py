"""Memory-sharing norm modules (MS-LN, MS-RMSNorm) over :mod:`lightning_lowmem.ops.norm`.

A memory-sharing norm saves its affine-free output ``z`` (and one fp32 rstd per row) instead of
its input, and returns the stock output ``y = gamma * z + beta`` (:func:`~lightning_lowmem.ops.norm_affine`,
which saves nothing new) tagged with ``z``. Every reader of ``y`` sees the stock values: residual
adds, returned hidden states, hooks, anything. A :class:`~lightning_lowmem.nn.LowMemLinear` built
with ``norm=`` this module recognises the tag and saves ``z`` in place of ``y``: the norm and all its
consumer linears keep one tensor. ``weight`` / ``bias`` keep their stock names, so checkpoints load
into the stock model and back. Model surgery builds exactly these modules.

Under autocast the output comes in the autocast dtype (as :class:`~lightning_lowmem.LowMemPrecision`
makes every norm's output), so stock linears reading it share one copy too; where a post-norm
model adds it to the residual stream, that stream continues in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_lowmem.ops.affine import norm_affine
from lightning_lowmem.ops.norm import ms_layer_norm, ms_rms_norm

_TAG = "_lowmem_shared_from"  # tensor attribute: (norm module, z) on a norm's output


def shared_from(x: torch.Tensor, norm: nn.Module) -> torch.Tensor | None:
    """The ``z`` that ``norm`` saved, when ``x`` is that norm's own output tensor (else ``None``)."""
    tag = getattr(x, _TAG, None)
    if tag is None or tag[0] is not norm:
        return None
    return x if tag[1] is None else tag[1]


def is_norm_output(x: torch.Tensor) -> bool:
    """Whether ``x`` is a memory-sharing norm's output (its consumers save the norm's ``z`` for it)."""
    return hasattr(x, _TAG)


class MemorySharingNorm(nn.Module):
    """Shared plumbing of the two norms: shape, eps, affine, ``from_module``, the tagged output."""

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

    @classmethod
    def from_module(cls, module: nn.Module):
        """Build from the matching stock norm, keeping its own Parameter objects (optimizers keep working)."""
        if not isinstance(module, cls.stock):
            raise TypeError(f"{cls.__name__}.from_module expects nn.{cls.stock.__name__}, got {type(module).__name__}")
        new = cls(module.normalized_shape, module.eps)
        new.weight, new.bias = module._parameters.get("weight"), module._parameters.get("bias")
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        z = self.op(x, self.normalized_shape, eps)
        y = norm_affine(z, self.weight, self.bias, z.dtype)  # z's dtype: the compute dtype under autocast
        if torch.is_grad_enabled():  # only a training forward saves anything worth sharing
            setattr(y, _TAG, (self, None if y is z else z))  # no reference cycle through y itself
        return y

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, saves=normalized output+rstd"


class MSLayerNorm(MemorySharingNorm):
    """LayerNorm that saves its normalized output, shared with the linear layers reading it."""

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
    """RMSNorm that saves its normalized output, shared with the linear layers reading it.

    ``eps=None`` means ``torch.finfo(x.dtype).eps``, as in ``nn.RMSNorm``.
    """

    stock = nn.RMSNorm
    op = staticmethod(ms_rms_norm)

    def __init__(
        self, normalized_shape: int | Sequence[int], eps: float | None = 1e-6, weight: nn.Parameter | None = None
    ) -> None:
        super().__init__(normalized_shape, eps, weight, None)
