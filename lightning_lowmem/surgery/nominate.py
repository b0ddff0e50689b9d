"""The nominate stage: every candidate module of the registries' families, verified, or left alone with why.

Gated MLPs come first, so that the activations inside the ones that fuse are theirs. Nothing here
changes the model; :mod:`.probe` then traces the norms' outputs and :mod:`.plan` decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from lightning_lowmem.nn import (
    GatedMLPBase,
    LowMemActivation,
    LowMemLinear,
    LowMemTransposedLinear,
    MemorySharingNorm,
    SeededDropout,
    litgpt,
)
from lightning_lowmem.nn.causal_lm import fused_loss_of
from lightning_lowmem.nn.peft import lora_dropouts, uses_dora
from lightning_lowmem.nn.rewritten import RewrittenForward, rewritten_forward_of
from lightning_lowmem.registry.dropouts import is_elementwise_dropout
from lightning_lowmem.registry.heads import names_causal_lm
from lightning_lowmem.surgery.functional import calls_activation_functions, rewrite
from lightning_lowmem.surgery.identify import (
    LinearKind,
    LinearLayers,
    NormSpec,
    NotConvertible,
    activation_of,
    fusable_head,
    fused_gated_mlp,
    gated_layout,
    is_plain,
    names_activation,
    names_norm,
    norm_spec,
    unnamed_activation,
)
from lightning_lowmem.surgery.options import Options
from lightning_lowmem.surgery.report import Entry, EntryKind

CONVERTED: dict[type[nn.Module], EntryKind] = {
    LowMemActivation: "activation",
    GatedMLPBase: "gated MLP",
    MemorySharingNorm: "norm",
    SeededDropout: "dropout",
}
"""The modules the surgery installs, by the kind of candidate they replaced."""
LOW_MEMORY_LINEARS = (LowMemLinear, LowMemTransposedLinear)

# Surgery replaces a module in its parent; the model itself has none to be replaced in.
_ROOT = "the model itself: modules are replaced in their parent, so convert a model that contains it"


@dataclass
class Candidates:
    """Verified candidates by module name, and the entries of those already decided."""

    activations: dict[str, str] = field(default_factory=dict)  # -> activation registry name
    norms: dict[str, NormSpec] = field(default_factory=dict)
    gated: dict[str, GatedMLPBase] = field(default_factory=dict)  # -> its verified fused replacement
    linears: dict[str, LinearKind] = field(default_factory=dict)  # every linear layer not yet sharing a norm
    dropouts: dict[str, float] = field(default_factory=dict)  # model dropouts -> p
    heads: list[str] = field(default_factory=list)  # causal LMs whose loss the fused head computes
    rewritten: dict[str, RewrittenForward] = field(default_factory=dict)  # forwards calling activation functions
    unrewritten: dict[str, str] = field(default_factory=dict)  # -> why its forward could not be rewritten
    litgpt_lora: dict[str, float] = field(default_factory=dict)  # LitGPT LoRA layers -> their dropout, folded
    litgpt_attention: list[str] = field(default_factory=list)  # LitGPT attentions whose SDPA inputs are laid out
    folded: dict[str, tuple[str, float]] = field(default_factory=dict)  # dropouts -> (the linear taking them in, p)
    entries: dict[str, Entry] = field(default_factory=dict)

    def leave(self, name: str, kind: EntryKind, module: nn.Module, reason: str) -> None:
        self.entries[name] = Entry(name, kind, type(module).__name__, "left alone", reason)

    def takes_dropout(self) -> dict[str, float]:
        """The linear layers that take in the dropout before them (a LoRA adapter's ``lora_A``, T5's ``wo``), with
        its probability."""
        return dict(self.folded.values())


def _already_converted(name: str, module: nn.Module) -> Entry | None:
    for cls, kind in CONVERTED.items():
        if isinstance(module, cls):
            return Entry(name, kind, type(module).__name__, "already converted", "")
    if rewritten_forward_of(module) is not None:
        return Entry(name, "functional", type(module).__name__, "already converted", "")
    if litgpt.attention_layout_of(module) is not None:
        return Entry(name, "attention", type(module).__name__, "already converted", "")
    return None


def _nominate_head(found: Candidates, name: str, model: nn.Module) -> None:
    """A causal LM whose loss the fused head can compute, or the reason it keeps its stock head. (Its entry is
    the model's own: the model is not replaced, its forward gains the fused loss.)"""
    if fused_loss_of(model) is not None:
        found.entries[f"{name}:head"] = Entry(name, "head", type(model).__name__, "already converted", "")
        return
    try:
        fusable_head(model)
        found.heads.append(name)
    except NotConvertible as err:
        found.entries[f"{name}:head"] = Entry(name, "head", type(model).__name__, "left alone", str(err))


def nominate(model: nn.Module, options: Options) -> Candidates:
    """Find and verify every candidate module; left-alone ones get their reason."""
    found = Candidates()
    fused_activations = _nominate_gated(model, options, found)
    if options.activation or options.gated:
        _nominate_functional(model, options, found)
    _nominate_litgpt_lora(model, options, found)
    if options.dropout:
        _nominate_lora_dropouts(model, options, found)
    linear_layers, takes_dropout = LinearLayers(), found.takes_dropout()
    for name, module in model.named_modules():
        if isinstance(module, LOW_MEMORY_LINEARS):  # a consumer already, or one a norm converted now may take
            kind = module.linear_kind if module.norm is None or name in takes_dropout else None
        else:
            kind = linear_layers.kind(module)
        if kind is not None:
            found.linears[name] = kind
        if options.head and names_causal_lm(module) and options.selected(name):
            _nominate_head(found, name, module)
        done = _already_converted(name, module)
        if done is not None:
            found.entries[name] = done
        elif name in fused_activations or name in found.entries or name in found.folded or not options.selected(name):
            continue
        elif options.dropout and is_elementwise_dropout(module) and module.p > 0:
            if is_plain(module):
                found.dropouts[name] = module.p
            else:
                found.leave(name, "dropout", module, "has hooks or a patched forward (a replacement would drop them)")
        elif module is model and (names_activation(module) or names_norm(module)):
            found.leave(name, "activation" if names_activation(module) else "norm", module, _ROOT)
        elif options.activation and names_activation(module):
            try:
                found.activations[name] = activation_of(module).name
            except NotConvertible as err:
                found.leave(name, "activation", module, str(err))
        elif options.norm and names_norm(module):
            try:
                found.norms[name] = norm_spec(module)
            except NotConvertible as err:
                found.leave(name, "norm", module, str(err))
        elif options.activation and (unnamed := unnamed_activation(module)) is not None:
            cls = type(module).__name__
            found.leave(name, "activation", module, (
                f"computes {unnamed.label}, but neither its class name nor a registration says so: "
                f"lightning_lowmem.register_activation({cls}, like={unnamed.name!r}) converts it"
            ))  # fmt: skip
    return found


def _nominate_gated(model: nn.Module, options: Options, found: Candidates) -> set[str]:
    """The gated MLPs first (their activations are theirs when they fuse); returns those activations' names."""
    fused_activations: set[str] = set()
    for name, module in model.named_modules():
        match = gated_layout(module) if options.gated and options.selected(name) else None
        if match is None:
            continue
        if module is model:
            found.leave(name, "gated MLP", module, _ROOT)
            continue
        try:
            found.gated[name] = fused = fused_gated_mlp(module, *match)
            fused_activations.add(f"{name}.{match[0].activation}")
        except NotConvertible as err:
            found.leave(name, "gated MLP", module, str(err))
            continue
        between = fused.product_dropout() if options.dropout else None
        if between is not None and _foldable(*(module._modules[child] for child in between)):
            found.folded[f"{name}.{between[0]}"] = (f"{name}.{between[1]}", module._modules[between[0]].p)
    return fused_activations


def _nominate_functional(model: nn.Module, options: Options, found: Candidates) -> None:
    """Modules whose forward calls activations as functions, with that forward rewritten (:mod:`.functional`);
    why the others' could not be (reported where the probe sees them call one: naming ``sigmoid`` proves no
    call)."""
    for name, module in model.named_modules():
        if name in found.gated or not options.selected(name) or not calls_activation_functions(module):
            continue
        if module is model or not module._modules or isinstance(module, tuple(CONVERTED)):
            continue  # the model's own forward may be running (deferred conversion); a leaf is one activation; ours
        if rewritten_forward_of(module) is not None:
            continue  # the main walk reports it as already converted
        if not is_plain(module):
            found.unrewritten[name] = "has hooks or a patched forward (a rewritten forward would skip them)"
            continue
        try:
            rewritten = rewrite(module, options.gated, options.bits if options.activation else None)
        except NotConvertible as err:
            found.unrewritten[name] = str(err)
            continue
        if rewritten is not None:
            found.rewritten[name] = rewritten


def _nominate_litgpt_lora(model: nn.Module, options: Options, found: Candidates) -> None:
    """LitGPT's LoRA layers: each gets :class:`~lightning_lowmem.nn.litgpt.LoRAForward` (its adapter shares a
    norm's tensor), taking in its dropout when that can be folded; and its attentions, an
    :class:`~lightning_lowmem.nn.litgpt.AttentionLayout`."""
    for name, layer in model.named_modules():
        if litgpt.is_attention(layer) and options.selected(name) and litgpt.attention_layout_of(layer) is None:
            found.litgpt_attention.append(name)
        if not litgpt.is_lora_layer(layer) or not options.selected(name) or not is_plain(layer):
            continue
        p = litgpt.dropout_probability(layer)
        dropout = f"{name}.lora_dropout"
        fold = options.dropout and p > 0 and is_plain(layer.lora_dropout) and options.selected(dropout)
        found.litgpt_lora[name] = p if fold else 0.0
        if fold:
            found.folded[dropout] = (f"{name}.lora_A", p)  # its adapter's x @ A.T takes it in


def _foldable(dropout: nn.Module, layer: nn.Module) -> bool:
    """Whether ``dropout`` can move into the linear ``layer`` that reads its output (``LowMemLinear(dropout=p)``)."""
    plain_linear = type(layer) is nn.Linear or (isinstance(layer, LowMemLinear) and not layer.dropout)
    return is_elementwise_dropout(dropout) and dropout.p > 0 and plain_linear and is_plain(layer) and is_plain(dropout)


def _nominate_lora_dropouts(model: nn.Module, options: Options, found: Candidates) -> None:
    """Every LoRA adapter's dropout that can be folded into its ``lora_A`` (which then saves its input, not a
    dropped copy), or the reason it stays (a DoRA adapter reads the dropped input itself)."""
    for layer_name, layer, adapter, dropout in lora_dropouts(model):
        name = f"{layer_name}.lora_dropout.{adapter}"
        if not is_elementwise_dropout(dropout) or dropout.p == 0 or not options.selected(name):
            continue  # nn.Identity at lora_dropout=0
        lora_a = layer.lora_A._modules.get(adapter)
        if uses_dora(layer, adapter):
            found.leave(name, "dropout", dropout, "a DoRA adapter: its forward reads the dropped input itself")
        elif lora_a is None or not _foldable(dropout, lora_a):
            found.leave(name, "dropout", dropout, "its lora_A is no plain linear layer to take it in")
        else:
            found.folded[name] = (f"{layer_name}.lora_A.{adapter}", dropout.p)
