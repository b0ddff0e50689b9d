"""Memory-sharing norm modules (MS-LN, MS-RMSNorm) over :mod:`lightning_lowmem.ops.norm`.

A memory-sharing norm saves its affine-free output ``z`` (and one fp32 rstd per row) instead of
its input, and returns the stock output ``y = gamma * z + beta`` tagged with ``z``. Every reader of ``y`` sees the stock values: residual
adds, returned hidden states, hooks, anything. (A frozen affine on CPU saves ``y`` itself, see
:func:`~lightning_lowmem.ops.norm.max_exact_columns`: its output is untagged, and its readers save it as it is.) A :class:`~lightning_lowmem.nn.LowMemLinear` built
with ``norm=`` this module recognises the tag and saves ``z`` in place of ``y``: the norm and all its
consumer linears keep one tensor. ``weight`` / ``bias`` keep their stock names, so checkpoints load
into the stock model and back; ``weight_offset`` covers norms that scale by ``weight + offset`` (Gemma's
RMSNorm: ``1 + weight``). Model surgery builds exactly these modules.

Under autocast the output comes in the autocast dtype (as :class:`~lightning_lowmem.LowMemPrecision`
makes every norm's output), so stock linears reading it share one copy too; where a post-norm
model adds it to the residual stream, that stream continues in the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from lightning_lowmem.ops.norm import memory_sharing_norm
from lightning_lowmem.registry.norms import NORMS

# tensor attribute on a norm's output: (norm module, z or None (the output is z), version, None); on a seeded
# dropout's output of one: (norm module, z, version, (p, seed)), its consumers save z and the seed
_TAG = "_lowmem_shared_from"


def whole_rows(view: torch.Tensor, base: torch.Tensor, row_shape: Sequence[int]) -> bool:
    """Whether ``view``, a view of the contiguous ``base``, holds whole rows of it (its trailing ``row_shape``) laid
    out as in ``base`` (``hidden[:, 0]``, ``hidden.view(-1, n)``): an affine over rows acts on it as on ``base``."""
    k, n = len(row_shape), math.prod(row_shape)
    rows = [(size, stride) for size, stride in zip(view.shape[:-k], view.stride()[:-k]) if size != 1]
    return (
        base.is_contiguous()
        and view.dim() >= k
        and tuple(view.shape[-k:]) == tuple(row_shape)
        and view.stride()[-k:] == base.stride()[-k:]
        and (view.storage_offset() - base.storage_offset()) % n == 0
        and all(stride % n == 0 for _, stride in rows)
    )


def _tagged_base(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` if it carries a tag, else its base (a view of a tagged output)."""
    return x if hasattr(x, _TAG) else x._base


def shared_from(x: torch.Tensor, norm: MemorySharingNorm) -> torch.Tensor | None:
    """The ``z`` that ``norm`` saved, laid out as ``x``, when ``x`` is that norm's own output or a view of whole
    rows of it, unchanged since (else ``None``: changed in place, it is no longer ``gamma * z + beta``; the
    surgery's probe leaves such a norm alone, this check catches paths the probe did not see, in eager mode:
    under torch.compile a tensor's version is not traceable)."""
    base = _tagged_base(x)
    tag = getattr(base, _TAG, None)
    if tag is None or tag[0] is not norm:
        return None
    if not torch.compiler.is_compiling() and tag[2] != base._version:
        return None
    z = base if tag[1] is None else tag[1]
    if x is base:
        return z
    if tag[3] is not None:  # a view of a seeded dropout's output: its mask was drawn by the whole output's indices
        return None
    if z.shape != base.shape or z.stride() != base.stride() or not whole_rows(x, base, norm.normalized_shape):
        return None
    return z.as_strided(x.size(), x.stride(), z.storage_offset() + x.storage_offset() - base.storage_offset())


def dropout_of(x: torch.Tensor) -> tuple[float, torch.Tensor] | None:
    """``(p, seed)`` of the seeded dropout that made ``x`` (or its base) from a norm's output, else ``None``: a
    consumer saving the norm's ``z`` for ``x`` rebuilds ``x`` from both (:func:`tag_dropped`)."""
    tag = getattr(_tagged_base(x), _TAG, None)
    return None if tag is None else tag[3]


def tag_dropped(y: torch.Tensor, x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """Mark ``y``, a seeded dropout of ``x``, as derived from ``x``'s norm when ``x`` is a memory-sharing norm's
    output, unchanged (BERT's embedding dropout sits between its norm and the first layer's linears). Returns
    ``y`` (a view of it under torch.compile, which sets no attribute on a custom operator's output)."""
    tag = getattr(x, _TAG, None)
    if tag is None or tag[3] is not None or (not torch.compiler.is_compiling() and tag[2] != x._version):
        return y
    if torch.compiler.is_compiling():
        y = y.view_as(y)
    setattr(y, _TAG, (tag[0], x if tag[1] is None else tag[1], y._version, (p, seed)))
    return y


Sharing = tuple["MemorySharingNorm", torch.Tensor]  # a norm and its z laid out as the tensor it was read from


def sharing_of(x: torch.Tensor) -> Sharing | None:
    """What lets another tensor holding ``x``'s values be read as ``x`` (:func:`tagged`): ``x``'s norm and its ``z``
    laid out as ``x``, for a norm's output or a view of whole rows of one; ``None`` for anything else (a seeded
    dropout of one included: its mask is drawn over the whole output). A checkpoint's recompute passes a detached
    copy of its tensor inputs, which carries no attribute of the input: a tiled MLP hands each tile's sharing on."""
    norm = norm_of_output(x)
    if norm is None or dropout_of(x) is not None:
        return None
    z = shared_from(x, norm)
    return None if z is None else (norm, z)


def tagged(x: torch.Tensor, sharing: Sharing | None) -> torch.Tensor:
    """``x`` tagged as the norm output that ``sharing`` (:func:`sharing_of`) describes; ``x`` as it is for ``None``."""
    if sharing is not None:
        setattr(x, _TAG, (sharing[0], sharing[1], x._version, None))
    return x


def norm_of_output(x: torch.Tensor) -> MemorySharingNorm | None:
    """The memory-sharing norm whose output ``x`` (or its base) is, if any."""
    tag = getattr(_tagged_base(x), _TAG, None)
    return None if tag is None else tag[0]


def is_norm_output(x: torch.Tensor) -> bool:
    """Whether ``x`` is a memory-sharing norm's output (its consumers save the norm's ``z`` for it)."""
    return hasattr(x, _TAG)


class MemorySharingNorm(nn.Module):
    """Shared plumbing of the norms: shape, eps, affine, ``from_module``, the tagged output.

    The affine parameters are registered under the names the stock module used (``weight``/``bias`` for
    torch's, timm's and Hugging Face's; whatever :func:`~lightning_lowmem.register_norm` named), so a
    checkpoint round-trips into the stock class strictly.
    """

    stock: type[nn.Module]  # the torch module ``from_module`` takes
    kind: str  # its entry in the norm registry
    center: bool  # LayerNorm (subtracts the mean) or RMSNorm: the registry entry's

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None,
        weight: nn.Parameter | None = None,
        bias: nn.Parameter | None = None,
        weight_offset: float = 0.0,
    ) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.normalized_shape, self.eps, self.weight_offset = shape, eps, float(weight_offset)
        self.weight_name, self.bias_name = "weight", "bias"
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)

    @staticmethod
    def of_kind(kind: str) -> type[MemorySharingNorm]:
        """The class for a norm registry kind: :class:`MSLayerNorm` or :class:`MSRMSNorm`."""
        return {cls.kind: cls for cls in MemorySharingNorm.__subclasses__()}[kind]

    def adopt(self, stock: nn.Module, weight: str | None, bias: str | None) -> MemorySharingNorm:
        """Hold ``stock``'s own affine Parameter objects under their names there (``None``: it has none)."""
        for attr, name in (("weight", weight), ("bias", bias)):
            del self._parameters[getattr(self, f"{attr}_name")]
            setattr(self, f"{attr}_name", name or attr)
            self.register_parameter(name or attr, stock._parameters.get(name) if name else None)
        return self

    def affine(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """``(weight, bias, weight_offset)``: the output is ``(weight + weight_offset) * z + bias``."""
        return self._parameters.get(self.weight_name), self._parameters.get(self.bias_name), self.weight_offset

    @classmethod
    def from_module(cls, module: nn.Module):
        """Build from the matching stock norm, keeping its own Parameter objects (optimizers keep working)."""
        if not isinstance(module, cls.stock):
            raise TypeError(f"{cls.__name__}.from_module expects nn.{cls.stock.__name__}, got {type(module).__name__}")
        return cls(module.normalized_shape, module.eps).adopt(module, "weight", "bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        name = "ms_layer_norm" if self.center else "ms_rms_norm"
        weight, bias, offset = self.affine()
        y, z = memory_sharing_norm(x, self.normalized_shape, eps, self.center, weight, bias, offset, name)
        if torch.is_grad_enabled() and z is not None:  # a training forward that saved z (not y: nothing to share)
            if torch.compiler.is_compiling():
                # dynamo (torch 2.14) sets no attribute on a custom operator's output, on a view it does
                y = y.view_as(y)
            setattr(y, _TAG, (self, None if y is z else z, y._version, None))  # no reference cycle through y itself
        return y

    def extra_repr(self) -> str:
        offset = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        names = (self.weight_name, self.bias_name) != ("weight", "bias")
        named = f", parameters=({self.weight_name!r}, {self.bias_name!r})" if names else ""
        return f"{self.normalized_shape}, eps={self.eps}{offset}{named}, saves=normalized output+rstd"


class MSLayerNorm(MemorySharingNorm):
    """LayerNorm that saves its normalized output, shared with the linear layers reading it.

    Args:
        normalized_shape: the trailing dimensions normalized over, as ``nn.LayerNorm``'s.
        eps: added to the variance (must be positive).
        weight: the scale Parameter, or None for none.
        bias: the shift Parameter, or None for none.
        weight_offset: the affine scales by ``weight + weight_offset``.
    """

    stock = nn.LayerNorm
    kind = "layer"
    center = NORMS[kind].center

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        weight: nn.Parameter | None = None,
        bias: nn.Parameter | None = None,
        weight_offset: float = 0.0,
    ) -> None:
        super().__init__(normalized_shape, eps, weight, bias, weight_offset)


class MSRMSNorm(MemorySharingNorm):
    """RMSNorm that saves its normalized output, shared with the linear layers reading it.

    Args:
        normalized_shape: the trailing dimensions normalized over, as ``nn.RMSNorm``'s.
        eps: added to the mean square; ``None`` means ``torch.finfo(x.dtype).eps``, as in ``nn.RMSNorm``.
        weight: the scale Parameter, or None for none.
        weight_offset: the affine scales by ``weight + weight_offset`` (Gemma: 1.0).
    """

    stock = nn.RMSNorm
    kind = "rms"
    center = NORMS[kind].center

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = 1e-6,
        weight: nn.Parameter | None = None,
        weight_offset: float = 0.0,
    ) -> None:
        super().__init__(normalized_shape, eps, weight, None, weight_offset)
