"""Recognise activations, gated MLPs and LayerNorm / RMSNorm layers across torch, timm and HF.

Class names only nominate candidates; each candidate is then *verified* by running it on a
test input and comparing with the reference function (for norms and linear layers with
randomised parameters), so a look-alike that computes something else (a sigmoid GLU, a
channels-first LayerNorm2d) is rejected with a reason instead of being converted; what the
probe identifies is kept (Gemma's RMSNorm scales by ``1 + weight``: a weight offset of 1; GPT-2's
``Conv1D`` is a linear layer with a transposed weight). Activations are checked against every
entry of the activation registry.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from lightning_lowmem.memory.saved_tensors import OBSERVER
from lightning_lowmem.nn import GatedMLP, GatedMLPBase, PackedGatedMLP, T5GatedMLP, TimmGluMlp
from lightning_lowmem.ops.activation_registry import ACTIVATIONS

_ACTIVATION_NAME = re.compile(r"gelu|silu|swish|mish", re.IGNORECASE)
_NORM_NAME = re.compile(r"layer_?norm|rms_?norm", re.IGNORECASE)
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")


class NotConvertible(Exception):
    """A candidate that must stay as it is; the message is the reason shown in the report."""


NormKind = Literal["layer", "rms"]
LinearKind = Literal["linear", "transposed"]  # x @ weight.T + bias (nn.Linear), x @ weight + bias (HF Conv1D)


@dataclass(frozen=True)
class NormSpec:
    """What a verified norm computes."""

    kind: NormKind
    normalized_shape: tuple[int, ...]
    eps: float | None
    weight_offset: float = 0.0  # the affine scales by ``weight + weight_offset``


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


@dataclass(frozen=True)
class GatedLayout:
    """A gated MLP layout by its child names: all of them, the activation, the projection reading the input;
    ``build`` makes the fused module (sharing the children) from the stock one and the activation's name."""

    children: frozenset[str]
    activation: str
    first: str
    build: Callable[[nn.Module, str], GatedMLPBase]
    marker: str | None = None  # an attribute telling it from a plain MLP with the same children


_GATED_LAYOUTS = (
    GatedLayout(  # Hugging Face LLaMA, Mistral, Qwen, Gemma, ...
        frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"}), "act_fn", "gate_proj",
        lambda m, act: GatedMLP.from_projections(m.gate_proj, m.up_proj, m.down_proj, act),
    ),
    GatedLayout(frozenset({"gate_up_proj", "down_proj", "activation_fn"}), "activation_fn", "gate_up_proj", PackedGatedMLP),
    GatedLayout(frozenset({"wi_0", "wi_1", "wo", "dropout", "act"}), "act", "wi_0", T5GatedMLP),  # T5 v1.1, Flan-T5
    GatedLayout(frozenset({"fc1_g", "fc1_x", "act", "drop1", "norm", "fc2", "drop2"}), "act", "fc1_g", TimmGluMlp),
    GatedLayout(  # timm's plain Mlp has the same children: ``gate_last`` tells them apart
        frozenset({"fc1", "act", "drop1", "norm", "fc2", "drop2"}), "act", "fc1", TimmGluMlp, marker="gate_last"
    ),
)  # fmt: skip


def gated_layout(module: nn.Module) -> GatedLayout | None:
    """The layout ``module`` has the children of (it may have more: :func:`fused_gated_mlp` says so), else ``None``."""
    children = set(module._modules)
    for layout in _GATED_LAYOUTS:
        if layout.children <= children and (layout.marker is None or hasattr(module, layout.marker)):
            return layout
    return None


def fused_gated_mlp(stock: nn.Module, layout: GatedLayout) -> GatedMLPBase:
    """The verified fused replacement of a stock gated MLP of ``layout``, sharing its children, or
    :class:`NotConvertible`.

    It must compute what the stock module computes on a random input (eval mode, so dropout cannot differ).
    """
    if not is_plain(stock):
        raise NotConvertible("has hooks or a patched forward (a replacement would drop them)")
    if set(stock._modules) != layout.children:
        raise NotConvertible(f"extra submodules {sorted(set(stock._modules) - layout.children)}")
    activation = activation_name(stock._modules[layout.activation])
    if not ACTIVATIONS[activation].gated:
        raise NotConvertible(f"the fused product has no kernel for {ACTIVATIONS[activation].label}")
    first = stock._modules[layout.first]
    parameter = next(first.parameters(), None)
    if parameter is None or not isinstance(getattr(first, "in_features", None), int):
        raise NotConvertible("its first projection is not a linear layer")
    new = layout.build(stock, activation)
    # a quantized projection (bitsandbytes) stores integers: probe in a floating dtype it computes in
    dtype = next((p.dtype for p in first.parameters() if p.is_floating_point()), torch.get_default_dtype())
    x = torch.randn(2, 3, first.in_features, dtype=dtype, device=parameter.device)
    try:
        with probe_mode(stock, train=False), torch.autocast(x.device.type, enabled=False):  # not in which precision
            same = torch.allclose(new(x), stock(x), rtol=1e-4, atol=1e-5)
    except Exception as err:  # noqa: BLE001 - any failure means: not the stock layout's computation
        raise NotConvertible(f"probe call failed ({type(err).__name__})") from None
    if not same:
        raise NotConvertible("computes something else than act(gate) * up followed by the down projection")
    return new


class LinearLayers:
    """Which modules are linear layers, and of which :data:`LinearKind`.

    An exact ``nn.Linear`` is one by its type. Any other module holding just a 2-d ``weight`` (and a
    ``bias``) is called on a random input with random parameters and compared with both forms:
    Falcon's ``FalconLinear`` (``x @ weight.T + bias``) is a "linear", GPT-2's ``Conv1D`` a
    "transposed". The verdict holds for every module of the same class, shapes and settings, so it
    is taken once for each (a 12-layer GPT-2 probes one ``Conv1D`` per shape).
    """

    def __init__(self) -> None:
        self._verdicts: dict[tuple, LinearKind | None] = {}

    def kind(self, module: nn.Module) -> LinearKind | None:
        if type(module) is nn.Linear:
            return "linear"
        params = dict(module.named_parameters(recurse=False))
        weight, bias = params.get("weight"), params.get("bias")
        if (
            weight is None
            or set(params) - {"weight", "bias"}
            or weight.dim() != 2
            or not weight.is_floating_point()
            or (bias is not None and (bias.dim() != 1 or bias.shape[0] not in weight.shape))
            or module._modules
            or any(True for _ in module.buffers(recurse=False))
            or isinstance(module, nn.Embedding)
            or not is_plain(module)
        ):
            return None
        settings = tuple(sorted((k, v) for k, v in vars(module).items() if isinstance(v, (bool, int, float, str))))
        key = (type(module), tuple(weight.shape), None if bias is None else bias.shape[0], settings)
        if key not in self._verdicts:
            self._verdicts[key] = _probe_linear(module, weight, bias)
        return self._verdicts[key]


def is_frozen_4bit_linear(module: nn.Module) -> bool:
    """A bitsandbytes ``Linear4bit`` (QLoRA's frozen nf4/fp4 base layer): its autograd function keeps only the
    quantized weight for backward (bitsandbytes >= 0.44), so it reads a norm's output saving nothing, as a frozen
    ``nn.Linear`` does. Not ``Linear8bitLt``: its function keeps its input (as a ``ctx`` attribute)."""
    bnb = sys.modules.get("bitsandbytes")  # not imported: no module is one
    return bnb is not None and isinstance(module, bnb.nn.Linear4bit)


def repacking_4bit_layers(model: nn.Module) -> list[nn.Module]:
    """The layers that repack their quantized weight in place on an eval forward without grad: bitsandbytes'
    ``Linear4bit`` (0.50 here) on a CPU with AVX512-BF16, for an inference kernel. The repack fails when the
    output size is no multiple of 32, rounds the block scales to bfloat16, and leaves the layer computing through
    a kernel without autograd: a training forward after it (after Lightning's sanity check or a validation epoch)
    gives the layers before it no gradient through it."""
    return [m for m in model.modules() if getattr(m, "support_avx512bf16_for_cpu", False)]


def unpack_4bit_weight(layer: nn.Module) -> bool:
    """Undo an earlier repack of ``layer``'s weight (as bitsandbytes does before saving it); whether there was one.
    Its block scales stay rounded to bfloat16: the repack lost those bits."""
    state = getattr(layer.weight, "quant_state", None)
    if not getattr(state, "packing_format_for_cpu", False):
        return False
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu_inverse(layer.weight.data, state)
    return True


@contextmanager
def probe_mode(model: nn.Module, train: bool) -> Iterator[None]:
    """The settings of a throwaway forward: every submodule in the mode asked for (each one's own flag back
    afterwards), grad only in training, and quantized weights left as they are (no repacking, see
    :func:`repacking_4bit_layers`)."""
    flags = [(m, m.training) for m in model.modules()]
    repacking = repacking_4bit_layers(model)
    for layer in repacking:
        layer.support_avx512bf16_for_cpu = False
    model.train(train)
    try:
        with torch.set_grad_enabled(train):
            yield
    finally:
        for m, training in flags:
            m.training = training
        for layer in repacking:
            layer.support_avx512bf16_for_cpu = True


def _probe_linear(module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearKind | None:
    """What ``module`` computes with random parameters (fp32, on their device): a :data:`LinearKind` or None."""
    trial = {"weight": torch.randn(weight.shape, device=weight.device)}
    if bias is not None:
        trial["bias"] = torch.randn(bias.shape, device=bias.device)
    forms: dict[LinearKind, torch.Tensor] = {"linear": trial["weight"], "transposed": trial["weight"].t()}
    for kind, as_linear in forms.items():
        if bias is not None and bias.shape[0] != as_linear.shape[0]:
            continue
        x = torch.randn(2, 3, as_linear.shape[1], device=weight.device)
        try:
            with torch.no_grad():
                y = functional_call(module, trial, (x,))
                expected = F.linear(x, as_linear, trial.get("bias"))
                if (
                    isinstance(y, torch.Tensor)
                    and y.shape == expected.shape
                    and torch.allclose(y, expected, 1e-4, 1e-4)
                ):
                    return kind
        except Exception:  # noqa: BLE001, S112 - a failed call means: not this form
            continue
    return None


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
    weight = params.get("weight")
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
    # by shape: an FSDP2 parameter may be a shard (DTensor)
    trial = {name: torch.randn(p.shape, dtype=torch.float64, device=p.device) for name, p in params.items()}
    try:
        with torch.no_grad():
            y = functional_call(module, trial, (x,))
    except Exception as err:  # noqa: BLE001 - any failure means: not a norm over the trailing dims
        raise NotConvertible(
            f"fails on rows of its normalized shape ({type(err).__name__}): not a norm over the last dimensions "
            "(channels-first?)"
        ) from None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        raise NotConvertible("its output is not shaped like its input")
    gamma, beta = trial.get("weight"), trial.get("bias")
    for kind in ("layer", "rms"):
        if kind == "rms" and beta is not None:
            continue
        z = _reference(kind, x, shape, eps, None, None)
        offset = _weight_offset(y.double(), z, gamma, beta)
        scale = None if gamma is None else gamma + offset
        if torch.allclose(y.double(), _reference(kind, x, shape, eps, scale, beta), rtol=1e-4, atol=1e-5):
            return NormSpec(kind, shape, eps, offset)
    raise NotConvertible("computes neither LayerNorm nor RMSNorm over the last dimensions (e.g. channels-first)")


def _weight_offset(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> float:
    """The ``c`` that fits ``y = z * (weight + c) + bias`` best (least squares; 0 without a weight), rounded:
    Gemma's RMSNorm scales by ``1 + weight``."""
    if weight is None:
        return 0.0
    rest = y - z * weight - (0 if bias is None else bias)
    return round(float((rest * z).sum() / (z * z).sum()), 6)
