"""What does one module compute? The registries nominate a module; running it on a probe decides.

Class names and registrations only nominate candidates (:func:`names_activation`, :func:`names_norm`);
each candidate is then *verified* by running it on a test input and comparing it with the registry's
reference (for norms and linear layers with randomised parameters), so a look-alike that computes
something else (a sigmoid GLU, a channels-first LayerNorm2d, a class registered as the wrong kind) is
refused with the reason and the measured difference instead of being converted. What the probe
identifies is kept (Gemma's RMSNorm scales by ``1 + weight``: a weight offset of 1; GPT-2's ``Conv1D``
is a linear layer with a transposed weight).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from lightning_lowmem.memory.saved_tensors import OBSERVER
from lightning_lowmem.nn.gated import GatedLayout, GatedMLPBase, gated_layouts
from lightning_lowmem.registry import activations, norms
from lightning_lowmem.registry.activations import ACTIVATIONS, Activation
from lightning_lowmem.registry.norms import NORMS, STOCK_LAYOUT, NormKindName, NormLayout
from lightning_lowmem.surgery.example import probe_mode


class NotConvertible(Exception):
    """A candidate that must stay as it is; the message is the reason shown in the report."""


LinearKind = Literal["linear", "transposed"]  # x @ weight.T + bias (nn.Linear), x @ weight + bias (HF Conv1D)


@dataclass(frozen=True)
class NormSpec:
    """What a verified norm computes, and the names its parameters have (kept by the converted norm)."""

    kind: NormKindName
    normalized_shape: tuple[int, ...]
    eps: float | None
    weight_offset: float = 0.0  # the affine scales by ``weight + weight_offset``
    weight_name: str | None = "weight"
    bias_name: str | None = "bias"


def foreign_hooks(module: nn.Module) -> list[object]:
    """The module's hooks but observers' (such as a running SavedTensorMeter's)."""
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values(), *module._backward_hooks.values())
    return [hook for hook in hooks if not getattr(hook, OBSERVER, False)]


def is_plain(module: nn.Module) -> bool:
    """No hooks (but observers) and no per-instance ``forward`` (e.g. accelerate offloading): safe to replace."""
    return not foreign_hooks(module) and "forward" not in module.__dict__


def _is_leaf(module: nn.Module) -> bool:
    return not any(module.children())


def names_activation(module: nn.Module) -> bool:
    """Nominated as an activation: a registered class, or a leaf whose class an activation entry names."""
    if activations.registered_as(module) is not None:
        return True
    return _is_leaf(module) and any(entry.names_module(module) for entry in ACTIVATIONS.values())


def names_norm(module: nn.Module) -> bool:
    """Nominated as a norm: a registered class, or a leaf whose class a norm kind names."""
    if norms.registered_as(module) is not None:
        return True
    return _is_leaf(module) and any(kind.names_module(module) for kind in NORMS.values())


def composite_norm(module: nn.Module) -> str | None:
    """Why a subclass of a norm the surgery converts is not nominated, where it holds modules of its own (timm's
    ``LayerNormAct2d``: a LayerNorm, then its dropout and activation): its output is not the norm's alone."""
    if names_norm(module) or not isinstance(module, tuple(m for kind in NORMS.values() for m in kind.modules)):
        return None
    inner = ", ".join(f"{name} ({type(child).__name__})" for name, child in module.named_children())
    return f"a {type(module).__mro__[1].__name__} subclass that runs modules of its own ({inner}) on the norm's output"


_ACTIVATION_PROBE = torch.linspace(-12.0, 12.0, 4801, dtype=torch.float64)


def _elementwise_output(module: nn.Module) -> torch.Tensor:
    """``module`` on the activation probe, in eval mode without grad (RNG untouched): an elementwise output."""
    if not is_plain(module):
        raise NotConvertible("has hooks or a patched forward (a replacement would drop them)")
    if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
        raise NotConvertible("has parameters or buffers")
    try:
        with torch.random.fork_rng(devices=[]), probe_mode(module, train=False):
            y = module(_ACTIVATION_PROBE.clone())
    except Exception as err:  # noqa: BLE001 - any failure means: not a plain elementwise activation
        raise NotConvertible(f"probe call failed ({type(err).__name__})") from None
    if not isinstance(y, torch.Tensor) or y.shape != _ACTIVATION_PROBE.shape:
        raise NotConvertible("not an elementwise activation")
    return y.double()


def _matching_activation(y: torch.Tensor, entries: tuple[Activation, ...]) -> Activation | None:
    return next((e for e in entries if torch.allclose(y, e.stock(_ACTIVATION_PROBE), rtol=0, atol=1e-9)), None)


def activation_of_function(function: Any) -> Activation | None:
    """The registry entry an elementwise ``function`` (a torch function with its other arguments bound) computes
    on the activation probe, if any."""
    try:
        with torch.no_grad():
            y = function(_ACTIVATION_PROBE.clone())
    except Exception:  # noqa: BLE001 - any failure means: not an elementwise activation
        return None
    if not isinstance(y, torch.Tensor) or y.shape != _ACTIVATION_PROBE.shape:
        return None
    return _matching_activation(y.double(), tuple(ACTIVATIONS.values()))


def activation_of(module: nn.Module) -> Activation:
    """The registry entry ``module`` provably computes (a registered class: the one it was registered as)."""
    y = _elementwise_output(module)
    registered = activations.registered_as(module)
    entries = (registered,) if registered is not None else tuple(ACTIVATIONS.values())
    entry = _matching_activation(y, entries)
    if entry is not None:
        return entry
    if registered is not None:
        difference = (y - registered.stock(_ACTIVATION_PROBE)).abs().max().item()
        raise NotConvertible(
            f"registered as {registered.label} (register_activation), but differs from it by up to {difference:.3g} "
            "on [-12, 12]"
        )
    raise NotConvertible(f"computes none of {', '.join(entry.label for entry in ACTIVATIONS.values())}")


def unnamed_activation(module: nn.Module) -> Activation | None:
    """The activation a parameter-free leaf of a class outside torch computes although nothing nominated it (its
    class name says nothing, it is not registered), for the report to say so; ``None`` for anything else."""
    if type(module).__module__.startswith("torch.") or not _is_leaf(module) or names_activation(module):
        return None
    try:
        return _matching_activation(_elementwise_output(module), tuple(ACTIVATIONS.values()))
    except NotConvertible:
        return None


def input_width(layer: nn.Module) -> int | None:
    """The input width of a linear layer (plain, LoRA-wrapped, quantized) or a norm, if it says."""
    width = getattr(layer, "in_features", None)
    if isinstance(width, int):
        return width
    shape = getattr(layer, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and len(shape) == 1 and isinstance(shape[0], int):
        return shape[0]
    inner = next((getattr(layer, name) for name in ("linear", "base_layer") if hasattr(layer, name)), None)
    return input_width(inner) if isinstance(inner, nn.Module) else None


def _projection_width(layer: nn.Module) -> int | None:
    """The input features of a gated MLP's first projection: :func:`input_width`, else those of its first 2-d
    floating Parameter read as ``nn.Linear``'s weight (a hand-written LoRA layer's base weight)."""
    weight = next((p for p in layer.parameters() if p.dim() == 2 and p.is_floating_point()), None)
    return input_width(layer) or (None if weight is None else weight.shape[1])


def fused_gated_mlp(stock: nn.Module, layout: GatedLayout, build: type[GatedMLPBase]) -> GatedMLPBase:
    """The verified fused replacement of a stock gated MLP of ``layout``, sharing its children, or
    :class:`NotConvertible`.

    It must compute what the stock module computes on a random input (eval mode, so dropout cannot differ).
    """
    if not is_plain(stock):
        raise NotConvertible("has hooks or a patched forward (a replacement would drop them)")
    if set(stock._modules) != layout.children:
        raise NotConvertible(f"extra submodules {sorted(set(stock._modules) - layout.children)}")
    activation = activation_of(stock._modules[layout.activation])
    if not activation.gated:
        raise NotConvertible(f"the fused product has no kernel for {activation.label}")
    first = stock._modules[layout.first]
    parameter = next(first.parameters(), None)
    width = _projection_width(first)
    if parameter is None or width is None:
        raise NotConvertible("its first projection is not a linear layer")
    new = build.from_stock(stock, activation.name)
    # a quantized projection (bitsandbytes) stores integers: probe in a floating dtype it computes in
    dtype = next((p.dtype for p in first.parameters() if p.is_floating_point()), torch.get_default_dtype())
    x = torch.randn(2, 3, width, dtype=dtype, device=parameter.device)
    try:
        with probe_mode(stock, train=False), torch.autocast(x.device.type, enabled=False):  # not in which precision
            same = torch.allclose(new(x), stock(x), rtol=1e-4, atol=1e-5)
    except Exception as err:  # noqa: BLE001 - any failure means: not the stock layout's computation
        raise NotConvertible(f"probe call failed ({type(err).__name__})") from None
    if not same:
        raise NotConvertible("computes something else than act(gate) * up followed by the down projection")
    return new


def gated_layout(module: nn.Module) -> tuple[GatedLayout, type[GatedMLPBase]] | None:
    """The gated MLP layout ``module`` has the children of (it may have more: :func:`fused_gated_mlp` says so),
    with the fused class that replaces it, else ``None``."""
    return next(((layout, cls) for layout, cls in gated_layouts() if layout.matches(module)), None)


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


def norm_spec(module: nn.Module) -> NormSpec:
    """The verified description of a LayerNorm / RMSNorm, or :class:`NotConvertible`: its parts where its
    layout says (the registered one, or torch's names), then its output on a probe against each kind's reference
    (only the registered kind for a registered class)."""
    registered = norms.registered_as(module)
    kinds, layout = ((registered[0],), registered[1]) if registered else (tuple(NORMS.values()), STOCK_LAYOUT)
    shape, eps = _norm_parts(module, layout, hint=not registered)
    # float64 input, randomised affine, rows at several scales (eps matters for the small ones), all on the
    # module's device (a GPU's norm probed on CPU rows fails): never on the default device
    params = dict(module.named_parameters(recurse=False))
    device = next(iter(params.values())).device if params else torch.device("cpu")
    scales = torch.logspace(-3, 2, 6, dtype=torch.float64, device=device).view(-1, *([1] * len(shape)))
    x = (torch.randn(6, *shape, dtype=torch.float64, device=device) + 0.5) * scales
    # by shape: an FSDP2 parameter may be a shard (DTensor)
    trial = {name: torch.randn(p.shape, dtype=torch.float64, device=device) for name, p in params.items()}
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
    y, gamma, beta = y.double(), trial.get(layout.weight), trial.get(layout.bias)
    differences = []
    for kind in kinds:
        if beta is not None and not kind.has_bias:
            continue
        z = kind.reference(x, shape, eps)
        offset = layout.offset if layout.offset is not None else _weight_offset(y, z, gamma, beta)
        expected = kind.reference(x, shape, eps, None if gamma is None else gamma + offset, beta)
        if torch.allclose(y, expected, rtol=1e-4, atol=1e-5):
            return NormSpec(kind.name, shape, eps, offset, layout.weight, layout.bias)
        differences.append((y - expected).abs().max().item())
    if registered:
        raise NotConvertible(
            f"registered as {kinds[0].label} (register_norm), but differs from it by up to {differences[0]:.3g} on "
            "the probe"
        )
    raise NotConvertible("computes neither LayerNorm nor RMSNorm over the last dimensions (e.g. channels-first)")


def _norm_parts(module: nn.Module, layout: NormLayout, hint: bool) -> tuple[tuple[int, ...], float | None]:
    """``(normalized_shape, eps)`` of a norm whose parameters are where ``layout`` says, or :class:`NotConvertible`
    (with ``hint``, a class with other parameters is told it can be registered)."""
    params = dict(module.named_parameters(recurse=False))
    unexpected = sorted(set(params) - {layout.weight, layout.bias})
    if unexpected or any(True for _ in module.buffers(recurse=False)):
        told = " (lightning_lowmem.register_norm can name its parameters)" if hint and unexpected else ""
        raise NotConvertible(f"unexpected parameters/buffers {unexpected}{told}")
    if not is_plain(module):
        raise NotConvertible("has hooks or a patched forward (they would see the affine-free output)")
    extra = [p for p in inspect.signature(type(module).forward).parameters.values() if p.kind != p.VAR_KEYWORD][2:]
    if extra:  # Mamba-2 hybrids' gated RMSNorm: norm(x, gate) normalizes x * silu(gate)
        raise NotConvertible(
            f"its forward takes {extra[0].name} besides the input (a gated norm): a norm of x alone is not it"
        )
    shape = getattr(module, "normalized_shape", None)
    if shape is None:
        if params.get(layout.weight) is None:
            raise NotConvertible("cannot tell its normalized shape")
        shape = params[layout.weight].shape
    try:
        eps = layout.eps_of(module)
    except ValueError as err:
        raise NotConvertible(str(err)) from None
    if eps is not None and not eps > 0:
        raise NotConvertible(f"eps={eps} (the memory-sharing kernels need eps > 0)")
    return ((shape,) if isinstance(shape, int) else tuple(shape)), eps


def _weight_offset(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> float:
    """The ``c`` that fits ``y = z * (weight + c) + bias`` best (least squares; 0 without a weight), rounded:
    Gemma's RMSNorm scales by ``1 + weight``."""
    if weight is None:
        return 0.0
    rest = y - z * weight - (0 if bias is None else bias)
    return round(float((rest * z).sum() / (z * z).sum()), 6)
