"""Recognise activations, gated MLPs and LayerNorm / RMSNorm layers across torch, timm and HF.

Class names only nominate candidates; each candidate is then *verified* by running it on a
test input and comparing with the reference function (for norms with randomised affine
parameters), so a look-alike that computes something else (a sigmoid GLU, Gemma's
``1 + weight`` RMSNorm, a channels-first LayerNorm2d) is rejected with a reason instead of
being converted. Activations are checked against every entry of the activation registry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.func import functional_call

from lightning_lowmem.memory.saved_tensors import OBSERVER
from lightning_lowmem.nn import GatedMLP, GatedMLPBase, TimmGluMlp
from lightning_lowmem.ops.activation_registry import ACTIVATIONS

_ACTIVATION_NAME = re.compile(r"gelu|silu|swish|mish", re.IGNORECASE)
_NORM_NAME = re.compile(r"layer_?norm|rms_?norm", re.IGNORECASE)
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")


class NotConvertible(Exception):
    """A candidate that must stay as it is; the message is the reason shown in the report."""


NormKind = Literal["layer", "rms"]


@dataclass(frozen=True)
class NormSpec:
    """What a verified norm computes."""

    kind: NormKind
    normalized_shape: tuple[int, ...]
    eps: float | None


def is_plain(module: nn.Module) -> bool:
    """No hooks (but observers, such as a running SavedTensorMeter's) and no per-instance ``forward``
    (e.g. accelerate offloading): safe to replace."""
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values(), *module._backward_hooks.values())
    return not any(not getattr(hook, OBSERVER, False) for hook in hooks) and "forward" not in module.__dict__


def is_activation_candidate(module: nn.Module) -> bool:
    if isinstance(module, (nn.GELU, nn.SiLU)):
        return True
    return bool(_ACTIVATION_NAME.search(type(module).__name__)) and not any(module.children())


def is_norm_candidate(module: nn.Module) -> bool:
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return True
    return bool(_NORM_NAME.search(type(module).__name__)) and not any(module.children())


def activation_name(module: nn.Module) -> str:
    """The registry name of the activation ``module`` provably computes."""
    if not is_plain(module):
        raise NotConvertible("has hooks or a patched forward (a replacement would drop them)")
    if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
        raise NotConvertible("has parameters or buffers")
    x = torch.linspace(-12.0, 12.0, 4801, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = module(x.clone())
    except Exception as err:  # noqa: BLE001 - any failure means: not a plain elementwise activation
        raise NotConvertible(f"probe call failed ({type(err).__name__})") from None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        raise NotConvertible("not an elementwise activation")
    for name, entry in ACTIVATIONS.items():
        if torch.allclose(y.double(), entry.stock(x), rtol=0, atol=1e-9):
            return name
    known = ", ".join(entry.label for entry in ACTIVATIONS.values())
    raise NotConvertible(f"computes none of {known}")


# Child names of the gated MLP layouts: Hugging Face LLaMA-family MLPs, timm SwiGLU and GluMlp.
_GATED_LAYOUTS = {
    "hf": ({"gate_proj", "up_proj", "down_proj", "act_fn"}, "act_fn"),
    "timm": ({"fc1_g", "fc1_x", "act", "drop1", "norm", "fc2", "drop2"}, "act"),
    "timm packed": ({"fc1", "act", "drop1", "norm", "fc2", "drop2"}, "act"),
}


def gated_layout(module: nn.Module) -> tuple[str, str] | None:
    """``(layout, activation child name)`` when ``module`` looks like a gated MLP, else ``None``.

    timm's plain ``Mlp`` has the packed GLU's child names; ``gate_last`` tells them apart.
    """
    children = set(module._modules)
    for layout, (names, act) in _GATED_LAYOUTS.items():
        if layout == "timm packed" and not hasattr(module, "gate_last"):
            continue
        if names == children or (layout == "hf" and names <= children):
            return ("timm" if layout.startswith("timm") else layout), act
    return None


def fused_gated_mlp(stock: nn.Module, layout: str, act_name: str) -> GatedMLPBase:
    """The verified fused replacement of a stock gated MLP of ``layout`` (``"hf"`` or ``"timm"``), sharing
    its children, or :class:`NotConvertible`.

    It must compute what the stock module computes on a random input (eval mode, so dropout cannot differ).
    """
    if not is_plain(stock):
        raise NotConvertible("has hooks or a patched forward (a replacement would drop them)")
    activation = activation_name(stock._modules[act_name])
    if not ACTIVATIONS[activation].gated:
        raise NotConvertible(f"the fused product has no kernel for {ACTIVATIONS[activation].label}")
    if layout == "hf" and set(stock._modules) != _GATED_LAYOUTS["hf"][0]:
        raise NotConvertible(f"extra submodules {sorted(set(stock._modules) - _GATED_LAYOUTS['hf'][0])}")
    first = stock.gate_proj if layout == "hf" else stock._modules.get("fc1_g", stock._modules.get("fc1"))
    parameter = next(first.parameters(), None)
    if parameter is None or not isinstance(getattr(first, "in_features", None), int):
        raise NotConvertible("its first projection is not a linear layer")
    if layout == "hf":
        new = GatedMLP.from_projections(stock.gate_proj, stock.up_proj, stock.down_proj, activation)
    else:
        new = TimmGluMlp(stock, activation)
    x = torch.randn(2, 3, first.in_features, dtype=parameter.dtype, device=parameter.device)
    flags = [(m, m.training) for m in stock.modules()]
    try:
        stock.eval()
        with torch.no_grad():
            same = torch.allclose(new(x), stock(x), rtol=1e-4, atol=1e-5)
    except Exception as err:  # noqa: BLE001 - any failure means: not the stock layout's computation
        raise NotConvertible(f"probe call failed ({type(err).__name__})") from None
    finally:
        for m, training in flags:
            m.training = training
    if not same:
        raise NotConvertible("computes something else than act(gate) * up followed by the down projection")
    return new


def _eps(module: nn.Module) -> float | None:
    for attr in _EPS_ATTRS:
        if hasattr(module, attr):
            value = getattr(module, attr)
            if value is None or isinstance(value, (int, float)):
                return None if value is None else float(value)
    raise NotConvertible("no eps attribute found")


def _reference(kind: str, x: torch.Tensor, shape: tuple[int, ...], eps: float | None, weight, bias) -> torch.Tensor:
    dims = tuple(range(-len(shape), 0))
    if kind == "layer":
        x = x - x.mean(dims, keepdim=True)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    z = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        z = z * weight
    return z if bias is None else z + bias


def norm_spec(module: nn.Module) -> NormSpec:
    """The verified description of a LayerNorm / RMSNorm, or :class:`NotConvertible`."""
    params = dict(module.named_parameters(recurse=False))
    if set(params) - {"weight", "bias"} or any(True for _ in module.buffers(recurse=False)):
        raise NotConvertible(f"unexpected parameters/buffers {sorted(set(params) - {'weight', 'bias'})}")
    if not is_plain(module):
        raise NotConvertible("has hooks or a patched forward (they would see the affine-free output)")
    weight, bias = params.get("weight"), params.get("bias")
    shape = getattr(module, "normalized_shape", None)
    if shape is None:
        if weight is None:
            raise NotConvertible("cannot tell its normalized shape")
        shape = weight.shape
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    eps = _eps(module)
    if eps is not None and not eps > 0:
        raise NotConvertible(f"eps={eps} (the memory-sharing kernels need eps > 0)")
    # float64 input, randomised affine, rows at several scales (eps matters for the small ones)
    scales = torch.logspace(-3, 2, 6, dtype=torch.float64).view(-1, *([1] * len(shape)))
    x = (torch.randn(6, *shape, dtype=torch.float64) + 0.5) * scales
    trial = {name: torch.randn_like(p, dtype=torch.float64) for name, p in params.items()}
    try:
        with torch.no_grad():
            y = functional_call(module, trial, (x,))
    except Exception as err:  # noqa: BLE001 - any failure means: not a norm over the trailing dims
        raise NotConvertible(f"probe call failed ({type(err).__name__})") from None
    for kind in ("layer", "rms"):
        if kind == "rms" and bias is not None:
            continue
        expected = _reference(kind, x, shape, eps, trial.get("weight"), trial.get("bias"))
        if (
            isinstance(y, torch.Tensor)
            and y.shape == x.shape
            and torch.allclose(y.double(), expected, rtol=1e-4, atol=1e-5)
        ):
            return NormSpec(kind, shape, eps)
    raise NotConvertible("output differs from LayerNorm/RMSNorm over the trailing dims (e.g. 1+weight, channels-first)")
