"""The options of the surgery: one dataclass, the only list of them and the only home of their docs.

:func:`~lightning_lowmem.apply_lowmem`, :func:`~lightning_lowmem.plan`,
:func:`~lightning_lowmem.max_batch_size` and :class:`~lightning_lowmem.LowMemBP` take them as keyword
arguments; :func:`takes_options` gives each of those its signature and its ``Args:`` from here, so IDEs,
``help()`` and LightningCLI (jsonargparse reads both) see every option with its type, default and doc.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from fnmatch import fnmatchcase
from typing import Annotated, Any, Literal, TypeVar, get_type_hints

from torch import nn
from typing_extensions import Doc

from lightning_lowmem.registry.activations import check_bits
from lightning_lowmem.surgery.budget import RUNGS

Switch = bool | Literal["auto", "off"]
SWITCHES = ("activation", "norm", "linear", "gated", "dropout", "head", "lora", "attention")
"""The options that switch a family of candidates on or off (each family names its ``switch``)."""
Patterns = str | Sequence[str] | None


@dataclass(frozen=True)
class Options:
    """What the surgery converts and how. Built from keyword arguments and validated at once (a typo or a
    pattern that matches no module fails before anything runs); afterwards the switches are bools and the
    patterns tuples."""

    activation: Annotated[
        Switch,
        Doc("""
        ``"auto"`` converts every activation module of the registry (GELU erf/tanh, SiLU, QuickGELU, Mish, and
        classes given to ``register_activation``) to its k-bit backward; ``False`` none."""),
    ] = "auto"
    norm: Annotated[
        Switch,
        Doc("""
        ``"auto"`` makes each LayerNorm / RMSNorm (and classes given to ``register_norm``) whose output linear
        layers read memory-sharing (decided by a probe forward on a real input); ``False`` none."""),
    ] = "auto"
    linear: Annotated[
        Switch,
        Doc("""
        ``"auto"`` lets every other ``nn.Linear`` recast its weight in backward, so no half-precision weight
        copy is saved under autocast; ``False`` keeps them."""),
    ] = "auto"
    gated: Annotated[
        Switch | Literal["exact"],
        Doc("""
        ``"auto"`` fuses ``act(gate) * up`` in every recognised gated MLP (saves the gate, plus the up projection
        only when the down projection does not save the product anyway: then ``up`` is recovered as
        ``product / act(gate)``, exact to the product's rounding, and kept where ``act(gate)`` is 0 at up to one
        element in 512); ``"exact"`` always saves gate and up (stock's gradients, one activation more);
        ``False`` leaves them, and ``activation`` then converts their activation like any other."""),
    ] = "auto"
    dropout: Annotated[
        Switch,
        Doc("""
        ``"auto"`` makes every ``nn.Dropout`` a seeded dropout that saves only its seed (not its mask), and folds
        each LoRA adapter's dropout into its ``lora_A``, which then saves what it saves without dropout (its
        input, or a memory-sharing norm's ``z``) and a seed; ``False`` leaves the dropouts."""),
    ] = "auto"
    head: Annotated[
        Switch,
        Doc("""
        ``"auto"`` makes every Hugging Face causal LM compute its training loss (with ``labels``) through the
        fused linear + cross-entropy, which never holds the logits (the output's ``logits`` are then ``None`` in
        training; evaluation and generation are unchanged); ``False`` keeps the stock head and its logits."""),
    ] = "auto"
    lora: Annotated[
        Switch,
        Doc("""
        ``"auto"`` gives LoRA layers that compute their adapter in their own forward (LitGPT's ``LoRALinear`` /
        ``LoRAQKVLinear``; hand-written ``linear(x) + scale * B(A(dropout(x)))`` layers, found by their data flow) a
        forward whose adapter shares its input norm's tensor and takes in its dropout; ``False`` leaves them (peft's
        adapters are linear layers: ``linear``, ``norm`` and ``dropout`` decide them)."""),
    ] = "auto"
    attention: Annotated[
        Switch,
        Doc("""
        ``"auto"`` lays LitGPT attention's inputs out so that SDPA keeps no ``qkv`` output alive and its output is
        what the output projection saves; ``False`` leaves it."""),
    ] = "auto"
    include: Annotated[
        Patterns,
        Doc("""
        fnmatch patterns of qualified module names to consider (default: all)."""),
    ] = None
    exclude: Annotated[Patterns, Doc("fnmatch patterns of module names to leave alone.")] = None
    bits: Annotated[
        int,
        Doc("""
        bits per element of the activations' approximate backward: 2 (the paper's constants), or 1, 3, 4
        (fitted tables; 3 is stored in 4). Fewer bits save less memory, more bits give a gradient closer to
        exact (benchmarks/RESULTS.md "kbit")."""),
    ] = 2
    budget_mib: Annotated[
        float | None,
        Doc("""
        fit the activation memory of a training step on the example input (its batch size) into this many
        MiB: after the conversion, the fewest repeated blocks are wrapped in activation checkpointing, the
        largest block's recomputation in backward included; ``report.budget`` says which and what it
        measured. A budget below what checkpointing every block achieves raises ValueError naming that
        minimum. ``LowMemBP`` fits it on the first training batch."""),
    ] = None
    rungs: Annotated[
        Sequence[str],
        Doc("""
        the steps the budget may take, cheapest first by bytes freed per second of cost: ``"tile"`` (an MLP run on
        tiles of the sequence, each recomputed in backward), ``"checkpoint"`` (a block recomputed in backward),
        ``"offload"`` (a checkpointed block's input kept in host memory); leave one out to forbid it."""),
    ] = RUNGS
    tile_tokens: Annotated[
        int | None,
        Doc("""
        positions per tile of a tiled MLP (the ``"tile"`` rung): its backward holds this many positions'
        intermediates at once; default the MLP's input features (Snowflake's ALST: about one weight matrix)."""),
    ] = None
    checkpoint: Annotated[
        Patterns,
        Doc("""
        fnmatch patterns of the modules the budget may checkpoint (default: the repeated blocks, e.g. timm
        ``blocks.*``, Hugging Face ``layers.*``)."""),
    ] = None
    verify: Annotated[
        bool,
        Doc("""
        compare the converted model's outputs with the stock model's on the probe's input (rolls back and
        raises on a mismatch)."""),
    ] = True
    measure: Annotated[
        bool,
        Doc("""
        record the saved-for-backward bytes of one forward before and after."""),
    ] = True

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)
        for name in SWITCHES:
            if not (name == "gated" and self.gated == "exact"):
                set_(name, _switch(getattr(self, name), name))
        for name in ("include", "exclude", "checkpoint"):
            set_(name, _patterns(getattr(self, name), name))
        set_("bits", check_bits("apply_lowmem", self.bits))
        rungs = (self.rungs,) if isinstance(self.rungs, str) else tuple(self.rungs)
        if not set(rungs) <= set(RUNGS):
            raise ValueError(f"apply_lowmem: rungs must be some of {RUNGS}, got {self.rungs!r}")
        set_("rungs", rungs)
        tile = self.tile_tokens
        if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
            raise ValueError(f"apply_lowmem: tile_tokens must be a positive number of positions, got {tile!r}")
        budget = self.budget_mib
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
            raise ValueError(f"apply_lowmem: budget_mib must be a positive number of MiB, got {budget!r}")
        for name in ("verify", "measure"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"apply_lowmem: {name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def parse(cls, options: dict[str, Any], owner: str = "apply_lowmem") -> Options:
        """Validated options from keyword arguments; an unknown name is a TypeError listing the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"{owner}: unknown option {unknown[0]!r}; the options are {', '.join(sorted(known))}")
        return cls(**options)

    def check_patterns(self, model: nn.Module) -> Options:
        """``self``, once every pattern matches some module of ``model`` (a ValueError naming it otherwise)."""
        names = [name for name, _ in model.named_modules()]
        for pattern in self.include + self.exclude + self.checkpoint:
            if not any(fnmatchcase(name, pattern) for name in names):
                raise ValueError(f"apply_lowmem: pattern {pattern!r} matches no module of {type(model).__name__}")
        return self

    @property
    def needs_input(self) -> bool:
        """Whether the surgery needs a real input: to trace the norms, or to fit a budget."""
        return self.norm or self.budget_mib is not None

    def excluded(self, name: str) -> bool:
        return any(fnmatchcase(name, p) for p in self.exclude)

    def selected(self, name: str) -> bool:
        return (not self.include or any(fnmatchcase(name, p) for p in self.include)) and not self.excluded(name)

    def as_dict(self) -> dict[str, Any]:
        """The options as keyword arguments (normalised)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _switch(value: object, name: str) -> bool:
    if value in ("auto", True):
        return True
    if value in (False, None, "off"):
        return False
    exact = " or 'exact'" if name == "gated" else ""
    raise ValueError(f"apply_lowmem: {name} must be 'auto', True, False or 'off'{exact}, got {value!r}")


def _patterns(value: object, name: str) -> tuple[str, ...]:
    patterns = (value,) if isinstance(value, str) else tuple(value or ())
    if not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"apply_lowmem: {name} must be a pattern or a list of patterns, got {value!r}")
    return patterns


def option_docs() -> dict[str, str]:
    """Each option's doc, from its ``Doc`` annotation."""
    hints = get_type_hints(Options, include_extras=True)
    return {
        f.name: next(a for a in hints[f.name].__metadata__ if isinstance(a, Doc)).documentation for f in fields(Options)
    }


def options_doc(indent: str = "        ") -> str:
    """The ``Args:`` lines of every option, for the docstrings of what takes them."""
    lines = []
    for name, doc in option_docs().items():
        words, line = doc.split(), f"{indent}{name}:"
        for word in words:
            if len(line) + 1 + len(word) > 112:
                lines.append(line)
                line = indent + "    " + word
            else:
                line += " " + word
        lines.append(line)
    return "\n".join(lines)


T = TypeVar("T", bound=Callable[..., Any])


def takes_options(func: T) -> T:
    """Give ``func`` (whose last parameter is ``**options``; a class: its ``__init__``) the options as
    keyword-only parameters in its signature, and their docs where its docstring says ``{options}``."""
    func.__doc__ = (func.__doc__ or "").replace("{options}", options_doc().lstrip())
    if isinstance(func, type):
        takes_options(func.__init__)
        return func
    signature = inspect.signature(func)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    hints = get_type_hints(Options)
    keyword = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in fields(Options)
        if f.name not in signature.parameters
    ]
    func.__signature__ = signature.replace(parameters=[*own, *keyword])
    return func
