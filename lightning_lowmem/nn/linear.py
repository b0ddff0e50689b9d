"""Linear layers (same parameters, same state_dict keys) that save less.

With ``norm`` set, a layer is a consumer of that memory-sharing norm: when its input is the norm's
output it saves the norm's ``z`` instead of the input (:func:`~lightning_lowmem.ops.affine_linear`);
any other input is an ordinary linear call. Under autocast it recasts its weight from the
parameter in backward instead of saving a half-precision copy. Outside autocast it casts an
input of another dtype to its weight's, as a peft LoRA layer's input cast would (surgery turns
that copy off, see :meth:`~lightning_lowmem.nn.adapters.peft.PeftLoRA.after_conversion`), saving a narrower
input as it is (fp32 adapters on a bf16 model share the bf16 tensor other layers save).

:class:`LowMemLinear` replaces an ``nn.Linear`` (or a subclass that computes the same, such as
Falcon's ``FalconLinear``); :class:`LowMemTransposedLinear` a linear layer that keeps its weight
as ``(in, out)``, such as Hugging Face's ``Conv1D`` (GPT-2). A module that calls ``F.linear`` itself
with a child's weight (timm's BEiT / EVA attention: ``F.linear(x, self.qkv.weight, qkv_bias)``)
shares through :func:`share_functional_linears`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_lowmem.nn.norm import MemorySharingNorm, dropout_of, shared_from
from lightning_lowmem.ops.affine import affine_linear
from lightning_lowmem.ops.autocast import autocast_dtype
from lightning_lowmem.ops.dropout import check_probability


def shared_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm: MemorySharingNorm | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``F.linear(F.dropout(x, dropout), weight, bias)`` that saves ``norm``'s ``z`` when ``x`` is that norm's
    output, or a seeded dropout of it (then with the seed), else ``x``: never a dropped copy, nor a
    half-precision weight copy."""
    z = None if norm is None else shared_from(x, norm)
    dropped = None if z is None else dropout_of(x)
    if dropped is not None and dropout:  # two masks: share neither, save the input as it is
        z = dropped = None
    compute = autocast_dtype(x) if weight.is_floating_point() else None
    if z is None and compute is None and x.dtype == weight.dtype and not dropout:
        return F.linear(x, weight, bias)
    gamma, beta, offset = (None, None, 0.0) if z is None else norm.affine()
    return affine_linear(x, weight, bias, compute or weight.dtype, z, gamma, beta, offset, dropout, dropped)


class _NormConsumer:
    """The ``norm`` a layer shares with: held outside ``_modules``, since the norm is registered where it
    lives and its parameters must not appear twice in state_dict() / parameters()."""

    def _set_norm(self, norm: MemorySharingNorm | None) -> None:
        self.__dict__["norm"] = norm

    def _sharing_repr(self) -> str:
        return ", recasts weight in backward" + (", saves its input norm's normalized output" if self.norm else "")


class LowMemLinear(_NormConsumer, nn.Linear):
    """An ``nn.Linear`` that shares its input norm's saved tensor and never saves a weight copy.

    Args:
        in_features: as ``nn.Linear``'s.
        out_features: as ``nn.Linear``'s.
        bias: as ``nn.Linear``'s.
        norm: the memory-sharing norm whose output it reads, if any: it then saves the norm's ``z``.
        dropout: a dropout probability applied to its input in training (a LoRA adapter's dropout, folded in):
            it saves its input (or ``z``) and a seed, never the dropped copy.
    """

    linear_kind = "linear"  # x @ weight.T + bias

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        norm: MemorySharingNorm | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device="meta")
        self._set_norm(norm)
        self.dropout = check_probability("LowMemLinear", dropout)

    @classmethod
    def from_linear(
        cls, linear: nn.Module, norm: MemorySharingNorm | None = None, dropout: float = 0.0
    ) -> LowMemLinear:
        """Wrap the own Parameter objects (optimizers and peft keep working) of ``linear``: an ``nn.Linear``,
        or any layer computing ``F.linear(x, linear.weight, linear.bias)``."""
        out_features, in_features = linear.weight.shape
        new = cls(in_features, out_features, bias=linear.bias is not None, norm=norm, dropout=dropout)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return shared_linear(x, self.weight, self.bias, self.norm, self.dropout if self.training else 0.0)

    def extra_repr(self) -> str:
        dropout = f", dropout={self.dropout} (saves a seed, not the dropped input)" if self.dropout else ""
        return super().extra_repr() + self._sharing_repr() + dropout


class LowMemTransposedLinear(_NormConsumer, nn.Module):
    """``x @ weight + bias`` with ``weight`` stored as ``(in_features, out_features)``, as Hugging Face's
    ``Conv1D`` (GPT-2) keeps it; otherwise :class:`LowMemLinear`."""

    linear_kind = "transposed"  # x @ weight + bias

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, norm: MemorySharingNorm | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape
        self.weight, self.bias = weight, bias
        self._set_norm(norm)

    @classmethod
    def from_linear(cls, linear: nn.Module, norm: MemorySharingNorm | None = None) -> LowMemTransposedLinear:
        """Wrap the own Parameter objects of ``linear``, a layer computing ``x @ linear.weight + linear.bias``."""
        return cls(linear.weight, linear.bias, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return shared_linear(x, self.weight.t(), self.bias, self.norm)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}" + self._sharing_repr()


def linear_arguments(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``(input, weight, bias)`` of an ``F.linear`` call, however it was spelled."""
    bound = dict(zip(("input", "weight", "bias"), args)) | kwargs
    return bound.get("input"), bound.get("weight"), bound.get("bias")


class _FunctionalSharing(TorchFunctionMode):
    """``F.linear(x, layer.weight, bias)`` for a norm-sharing :class:`LowMemLinear` ``layer`` shares as
    ``layer(x)`` does (with the bias given)."""

    def __init__(self, layers: dict[int, LowMemLinear]) -> None:
        super().__init__()
        self.layers = layers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = linear_arguments(args, kwargs)
            layer = self.layers.get(id(weight))
            if layer is not None and layer.weight is weight and isinstance(x, torch.Tensor):
                return shared_linear(x, weight, bias, layer.norm)
        return func(*args, **kwargs)


_ACTIVE = "_lowmem_functional_sharing"  # module attribute: the modes its running forwards entered


def _enter_functional_sharing(module: nn.Module, args: tuple) -> None:
    layers = {id(m.weight): m for m in module.modules() if isinstance(m, LowMemLinear) and m.norm is not None}
    mode = _FunctionalSharing(layers)
    mode.__enter__()
    module.__dict__.setdefault(_ACTIVE, []).append(mode)


def _exit_functional_sharing(module: nn.Module, args: tuple, output: Any) -> None:
    if module.__dict__.get(_ACTIVE):  # empty when an earlier pre-hook failed before ours ran
        module.__dict__[_ACTIVE].pop().__exit__(None, None, None)


def shares_functional_linears(module: nn.Module) -> bool:
    """Whether :func:`share_functional_linears` was applied to ``module``."""
    return _enter_functional_sharing in module._forward_pre_hooks.values()


def share_functional_linears(module: nn.Module) -> list[RemovableHandle]:
    """Make ``module``'s own ``F.linear`` calls with the weight of a norm-sharing :class:`LowMemLinear` below it
    share the norm's ``z`` as that layer's call would (forward hooks; nothing when already done). Returns the
    hook handles (removing them undoes it)."""
    if shares_functional_linears(module):
        return []
    return [
        module.register_forward_pre_hook(_enter_functional_sharing),
        module.register_forward_hook(_exit_functional_sharing, always_call=True),
    ]
