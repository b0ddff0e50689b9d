"""The norms that can share their saved tensor: one entry per kind, and where each class keeps its parts.

A :class:`NormKind` says what the norm computes (LayerNorm centres its rows, RMSNorm does not: the
``center`` flag the kernels take), the float64 reference the surgery checks a module against, what the
memory-sharing norm is called in the report, and which modules may be one (torch classes and a
class-name pattern for timm's, Hugging Face's and other libraries'). A :class:`NormLayout` says where a
class keeps its weight, bias and eps, and whether its affine scales by ``weight + offset`` (Gemma's
RMSNorm: ``1 + weight``); classes users register with :func:`register_norm` carry theirs.

:func:`is_normalization` is the wider question the precision plugin asks (which layers keep fp32
parameters): every kind here, every registered class, and torch's other normalization layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

NormKindName = Literal["layer", "rms"]
EPS_ATTRIBUTES = ("eps", "variance_epsilon", "epsilon")
"""Where a class that was not registered keeps its eps: the first of these attributes it has."""


@dataclass(frozen=True)
class NormKind:
    """One kind of norm: what it computes and which modules may be one."""

    name: NormKindName
    label: str
    converted_label: str
    center: bool
    has_bias: bool
    modules: tuple[type[nn.Module], ...]
    pattern: str
    """Class names that nominate a leaf module (matched case-insensitively)."""

    def reference(
        self,
        x: torch.Tensor,
        shape: tuple[int, ...],
        eps: float | None,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The norm over the trailing ``shape`` of ``x`` with the affine ``weight * z + bias`` (either may be
        None); ``eps`` None is ``torch.finfo(x.dtype).eps``, as ``nn.RMSNorm``'s."""
        dims = tuple(range(-len(shape), 0))
        if self.center:
            x = x - x.mean(dims, keepdim=True)
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        z = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
        if weight is not None:
            z = z * weight
        return z if bias is None else z + bias

    def names_module(self, module: nn.Module) -> bool:
        """Whether ``module``'s class (a torch class, or a name matching :attr:`pattern`) says it may be this kind."""
        return isinstance(module, self.modules) or bool(re.search(self.pattern, type(module).__name__, re.IGNORECASE))


NORMS: dict[str, NormKind] = {
    "layer": NormKind(
        "layer", "LayerNorm", "MS-LN", True, has_bias=True, modules=(nn.LayerNorm,), pattern="layer_?norm"
    ),
    "rms": NormKind("rms", "RMSNorm", "MS-RMSNorm", False, has_bias=False, modules=(nn.RMSNorm,), pattern="rms_?norm"),
}


@dataclass(frozen=True)
class NormLayout:
    """Where a norm class keeps its parts: parameter names (``None``: it has none), eps (an attribute name, a
    number, or ``None``: the first of :data:`EPS_ATTRIBUTES`), and the offset its affine adds to the weight
    (``None``: fitted by the surgery's probe)."""

    weight: str | None = "weight"
    bias: str | None = "bias"
    eps: str | float | None = None
    offset: float | None = None

    def eps_of(self, module: nn.Module) -> float | None:
        """``module``'s eps (``None``: the dtype's, as ``nn.RMSNorm``'s default); ValueError where there is none."""
        if isinstance(self.eps, (int, float)):
            return float(self.eps)
        for attr in (self.eps,) if self.eps is not None else EPS_ATTRIBUTES:
            value = getattr(module, attr, "missing")
            if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
                return None if value is None else float(value)
        where = f"attribute {self.eps!r}" if self.eps is not None else f"any of the attributes {EPS_ATTRIBUTES}"
        raise ValueError(f"no eps found ({where}; register_norm(..., eps=) names it or gives its value)")


STOCK_LAYOUT = NormLayout()
"""Where torch's, timm's and Hugging Face's norms keep their parts."""

REGISTERED: dict[type[nn.Module], tuple[NormKind, NormLayout]] = {}
"""User classes -> their kind and layout (:func:`register_norm`)."""

_OTHER_NORMALIZATION = (
    nn.GroupNorm, nn.LocalResponseNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)  # fmt: skip
_NORMALIZATION_NAME = re.compile(r"norm(\d+d)?$", re.IGNORECASE)


def register_norm(
    cls: type[nn.Module],
    kind: NormKindName,
    *,
    weight: str | None = "weight",
    bias: str | None = "bias",
    eps: str | float = "eps",
    offset: float = 0.0,
) -> type[nn.Module]:
    """Declare that instances of ``cls`` are a LayerNorm (``kind="layer"``) or an RMSNorm (``"rms"``) over their
    last dimension, whatever the class and its parameters are called.

    Args:
        cls: the norm class (an ``nn.Module`` subclass; its subclasses are covered too).
        kind: ``"layer"`` (subtracts the row mean) or ``"rms"``.
        weight: the name of its scale parameter, or ``None`` for none.
        bias: the name of its shift parameter, or ``None`` for none (an RMSNorm has none).
        eps: the name of its eps attribute, or the eps itself where the class hard-codes it.
        offset: the affine scales by ``weight + offset`` (Gemma's RMSNorm: 1.0).

    Each instance is still checked against the reference on a probe; one that computes something else is left
    alone, with the difference measured in the report. The converted norm keeps the parameters under these
    names, so ``state_dict`` round-trips into ``cls`` strictly. Returns ``cls``.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_norm: expected an nn.Module subclass, got {cls!r}")
    if kind not in NORMS:
        raise ValueError(f"register_norm: kind must be one of {tuple(NORMS)}, got {kind!r}")
    if bias is not None and not NORMS[kind].has_bias:
        raise ValueError(f"register_norm: an RMSNorm has no bias; pass bias=None (got bias={bias!r})")
    if not (isinstance(eps, str) or (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0)):
        raise ValueError(f"register_norm: eps must be an attribute name or a positive number, got {eps!r}")
    for what, name in (("weight", weight), ("bias", bias)):
        if name is not None and not (isinstance(name, str) and name.isidentifier()):
            raise ValueError(f"register_norm: {what} must be a parameter name or None, got {name!r}")
    REGISTERED[cls] = (NORMS[kind], NormLayout(weight, bias, eps, float(offset)))
    return cls


def registered_as(module: nn.Module) -> tuple[NormKind, NormLayout] | None:
    """The kind and layout ``module``'s class was registered with (the nearest registered base class), if any."""
    for cls in type(module).__mro__:
        if cls in REGISTERED:
            return REGISTERED[cls]
    return None


def is_normalization(module: nn.Module) -> bool:
    """A layer the precision plugin keeps in fp32: a norm of any kind here, a registered one, torch's other
    normalization layers, or any class whose name ends in ``Norm`` (``LlamaRMSNorm``, ``T5LayerNorm``, ...)."""
    return (
        isinstance(module, (*(m for kind in NORMS.values() for m in kind.modules), *_OTHER_NORMALIZATION))
        or registered_as(module) is not None
        or bool(_NORMALIZATION_NAME.search(type(module).__name__))
    )
