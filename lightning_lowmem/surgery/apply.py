"""``apply_lowmem``: verified, all-or-nothing model surgery, and the report of what it did.

Activations (GELU erf/tanh, SiLU) become ReGELU2 / ReSiLU2 wherever they are modules, except
inside gated MLPs (LLaMA-family, timm SwiGLU / GluMlp), which become one fused, exact, low-memory
``act(gate) * up`` (:mod:`lightning_lowmem.nn.gated`), verified against the stock MLP. A
LayerNorm / RMSNorm becomes a memory-sharing norm only where a probe forward proves its
output reaches nothing but linear layers (see :mod:`.dataflow`); its affine moves into those
linears (:mod:`.modules`) without renaming any parameter, so checkpoints stay interchangeable
with the stock model. Every other ``nn.Linear`` recasts its weight in backward instead of
saving a half-precision copy under autocast. With an example input the converted model is
checked against the stock one and everything is rolled back on a mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.nn import ReGELU2, ReSiLU2
from lightning_lowmem.nn.gated import GatedMLPBase
from lightning_lowmem.surgery import dataflow
from lightning_lowmem.surgery.detect import (
    NormSpec,
    NotConvertible,
    activation_kind,
    gated_layout,
    gated_mlp_kind,
    is_activation_candidate,
    is_norm_candidate,
    is_plain,
    norm_spec,
)
from lightning_lowmem.surgery.modules import DeferredAffineNorm, LowMemLinear, fused_gated_mlp

MIB = float(1 << 20)
_CONVERTED_TYPES = (ReGELU2, ReSiLU2, DeferredAffineNorm, LowMemLinear, GatedMLPBase)
_NEW_ACTIVATION = {
    "gelu": lambda bits: ReGELU2(bits=bits),
    "gelu_tanh": lambda bits: ReGELU2("tanh", bits=bits),
    "silu": lambda bits: ReSiLU2(bits=bits),
}
_NEW_NAME = {"gelu": "ReGELU2 (erf)", "gelu_tanh": "ReGELU2 (tanh)", "silu": "ReSiLU2"}


@dataclass(frozen=True)
class Entry:
    """One candidate module: what it was, and what happened to it (``detail`` says why)."""

    name: str
    kind: str  # "activation" | "gated MLP" | "norm" | "functional"
    was: str
    status: str  # "converted" | "already converted" | "left alone"
    detail: str


@dataclass
class LowMemReport:
    """What :func:`apply_lowmem` changed and did not change, and the memory it measured.

    ``saved_bytes_before`` / ``_after`` are the bytes saved for backward by one training-mode
    forward on the example input (``None`` without one).
    """

    entries: list[Entry] = field(default_factory=list)
    linears: int = 0
    saved_bytes_before: int | None = None
    saved_bytes_after: int | None = None

    def _with(self, status: str, kind: str | None = None) -> list[Entry]:
        return [e for e in self.entries if e.status == status and kind in (None, e.kind)]

    @property
    def converted(self) -> list[Entry]:
        return self._with("converted")

    @property
    def left_alone(self) -> list[Entry]:
        return self._with("left alone")

    def status(self, name: str) -> str:
        """The status of the module called ``name`` (KeyError if it was no candidate)."""
        for entry in self.entries:
            if entry.name == name:
                return entry.status
        raise KeyError(f"{name!r} was not a candidate for conversion")

    @property
    def reduction(self) -> float | None:
        """Fraction of saved-for-backward bytes removed, when measured."""
        if not self.saved_bytes_before or self.saved_bytes_after is None:
            return None
        return 1.0 - self.saved_bytes_after / self.saved_bytes_before

    def summary(self) -> str:
        counts = ", ".join(
            f"{len(self._with(status, kind))} {kind}s {status}"
            for kind in ("activation", "gated MLP", "norm")
            for status in ("converted", "already converted", "left alone")
            if self._with(status, kind)
        )
        line = f"LowMemBP: {counts or 'no candidates'}; {self.linears} linear layers recast weights in backward"
        if self.reduction is not None:
            line += (
                f"; saved for backward by one forward: {self.saved_bytes_before / MIB:.2f} MiB -> "
                f"{self.saved_bytes_after / MIB:.2f} MiB (-{100 * self.reduction:.1f}%)"
            )
        return line

    def table(self) -> str:
        """A ModelSummary-like table: every candidate, its fate and the reason."""
        header = ("", "Name", "Kind", "Was", "Status", "Detail")
        rows = [(str(i), e.name, e.kind, e.was, e.status, e.detail) for i, e in enumerate(self.entries)]
        widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
        fmt = lambda row: " | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        rule = "-" * len(fmt(header))
        return "\n".join([rule, fmt(header), rule, *map(fmt, rows), rule, self.summary()])

    def __str__(self) -> str:
        return self.table()


def _mode(option: Any, name: str) -> bool:
    if option in ("auto", True):
        return True
    if option in (False, None, "off"):
        return False
    raise ValueError(f"apply_lowmem: {name} must be 'auto', True, False or 'off', got {option!r}")


def _patterns(option: str | Sequence[str] | None) -> list[str]:
    return [option] if isinstance(option, str) else list(option or [])


def _references(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (parent, attribute) holding each submodule, so shared modules are replaced everywhere."""
    refs: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for attr, child in parent._modules.items():
            if child is not None:
                refs.setdefault(id(child), []).append((parent, attr))
    return refs


class _Surgery:
    """Replacements and flag changes done so far, undone in reverse on any failure."""

    def __init__(self, model: nn.Module) -> None:
        self.refs = _references(model)
        self.undo: list[tuple[object, str, object]] = []

    def replace(self, old: nn.Module, new: nn.Module) -> None:
        for parent, attr in self.refs[id(old)]:
            self.set(parent, attr, new)

    def set(self, obj: object, attr: str, value: object) -> None:
        self.undo.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    def rollback(self) -> None:
        for obj, attr, value in reversed(self.undo):
            setattr(obj, attr, value)
        self.undo.clear()


def _saved_bytes(model: nn.Module, example: Any) -> int:
    with dataflow.isolated(model, train=True), SavedTensorMeter(model) as meter:
        dataflow.call(model, example)
    return meter.total_bytes


def _eval_outputs(model: nn.Module, example: Any) -> list[torch.Tensor]:
    with dataflow.isolated(model, train=False):
        return [t.detach().float() for t in dataflow.tensors_in(dataflow.call(model, example))]


def _check_same(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    half = torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda"))
    tolerance = 5e-2 if half else 1e-4
    if len(before) != len(after):
        raise RuntimeError(f"the converted model returns {len(after)} tensors instead of {len(before)}")
    for i, (a, b) in enumerate(zip(before, after)):
        scale = max(a.abs().max().item() if a.numel() else 0.0, 1.0)
        if a.shape != b.shape or not torch.allclose(a, b, rtol=tolerance, atol=tolerance * scale):
            diff = (a - b).abs().max().item() if a.shape == b.shape else "shape"
            raise RuntimeError(f"output {i} of the converted model differs from the stock model (max diff {diff})")


def _norm_detail(name: str, spec: NormSpec, consumers: list[str]) -> str:
    """E.g. ``MS-LN, affine applied by attn.qkv`` (consumer names relative to the norm's parent)."""
    kind = "MS-LN" if spec.kind == "layer" else "MS-RMSNorm"
    parent = name.rpartition(".")[0] + "." if "." in name else ""
    return f"{kind}, affine applied by {', '.join(c.removeprefix(parent) for c in consumers)}"


def _gated_detail(kind: str, new: GatedMLPBase) -> str:
    """E.g. ``SwiGLU fused, saves gate (+ the output its down projection saves)``."""
    name = {"silu": "SwiGLU", "gelu": "GeGLU", "gelu_tanh": "GeGLU (tanh)"}[kind]
    saves = "gate (+ the product its down projection saves)" if new.resolved_mode() == "gate" else "gate and up"
    return f"{name} fused, saves {saves}"


def _casts_itself(module: nn.Module) -> bool:
    """A peft LoRA layer whose every ``lora_A`` is a :class:`LowMemLinear`, which casts its input
    itself: peft's own input cast would only add a copy (which ``lora_A`` then saves)."""
    lora_a = getattr(module, "lora_A", None)
    return (
        getattr(module, "cast_input_dtype_enabled", False) is True
        and isinstance(lora_a, nn.ModuleDict)
        and len(lora_a) > 0
        and all(isinstance(m, LowMemLinear) for m in lora_a.values())
    )


def apply_lowmem(
    model: nn.Module,
    activation: str | bool = "auto",
    norm: str | bool = "auto",
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    *,
    linear: str | bool = "auto",
    gated: str | bool = "auto",
    example_input: Any = None,
    verify: bool = True,
    measure: bool = True,
    bits: int = 2,
) -> LowMemReport:
    """Convert ``model`` in place for low-memory backpropagation and report what changed.

    Args:
        model: any ``nn.Module`` (timm, Hugging Face, peft, custom). Run it before creating the
            optimizer and before DDP/FSDP wrapping; parameters stay the same objects anyway.
        activation: ``"auto"`` converts every GELU / SiLU module; ``False`` none.
        norm: ``"auto"`` converts each LayerNorm / RMSNorm whose output provably reaches only
            linear layers (needs ``example_input`` to trace the data flow); ``False`` none.
        include: fnmatch patterns of qualified module names to consider (default: all).
        exclude: fnmatch patterns of module names to leave alone.
        linear: ``"auto"`` lets every other ``nn.Linear`` recast its weight in backward, so no
            half-precision weight copy is saved under autocast; ``False`` keeps them.
        gated: ``"auto"`` fuses ``act(gate) * up`` in every recognised gated MLP (exact; saves the
            gate, plus the up projection only when the down projection does not save the
            product anyway); ``False`` leaves them, and then ``activation`` converts their
            activation like any other.
        example_input: an input as Lightning's ``example_input_array`` (tensor, tuple of
            positional args, or dict of keyword args); enables norm conversion, the check of
            the outputs and the memory measurement.
        verify: compare the converted model's outputs with the stock model's (rolls back and
            raises on a mismatch).
        measure: record the saved-for-backward bytes of one forward before and after.
        bits: bits per element of the activations' approximate backward: 2 (default, the
            paper's constants), or 1, 3, 4 (fitted tables; 3 is stored in 4 bits). Fewer bits
            save less memory, more bits a gradient closer to exact (benchmarks/RESULTS.md "kbit").

    Returns:
        The :class:`LowMemReport`. Running it again on a converted model changes nothing.
    """
    if bits not in (1, 2, 3, 4):
        raise ValueError(f"apply_lowmem: bits must be 1, 2, 3 or 4, got {bits!r}")
    do_act, do_norm, do_linear = _mode(activation, "activation"), _mode(norm, "norm"), _mode(linear, "linear")
    do_gated = _mode(gated, "gated")
    include, exclude = _patterns(include), _patterns(exclude)
    named = dict(model.named_modules())
    for pattern in include + exclude:
        if not any(fnmatchcase(name, pattern) for name in named):
            raise ValueError(f"apply_lowmem: pattern {pattern!r} matches no module of {type(model).__name__}")

    def selected(name: str) -> bool:
        return (not include or any(fnmatchcase(name, p) for p in include)) and not any(
            fnmatchcase(name, p) for p in exclude
        )

    report = LowMemReport()
    entries: dict[str, Entry] = {}
    activations: dict[str, str] = {}
    norms: dict[str, NormSpec] = {}
    gated_mlps: dict[str, tuple[str, str]] = {}  # name -> (layout, activation kind)
    inside_gated: set[str] = set()  # their activation modules, converted with them
    for name, module in named.items():
        was = type(module).__name__
        if isinstance(module, _CONVERTED_TYPES):
            if not isinstance(module, LowMemLinear):
                kind = {ReGELU2: "activation", ReSiLU2: "activation", DeferredAffineNorm: "norm"}.get(type(module))
                entries[name] = Entry(name, kind or "gated MLP", was, "already converted", "")
            continue
        layout = gated_layout(module) if do_gated and selected(name) else None
        if layout is not None:
            try:
                kind = gated_mlp_kind(module, *layout)
                gated_mlps[name] = (layout[0], kind)
                inside_gated.add(f"{name}.{layout[1]}")
            except NotConvertible as err:
                entries[name] = Entry(name, "gated MLP", was, "left alone", str(err))
        if name in inside_gated:
            continue
        if do_act and is_activation_candidate(module) and selected(name):
            try:
                activations[name] = activation_kind(module)
            except NotConvertible as err:
                entries[name] = Entry(name, "activation", was, "left alone", str(err))
        elif do_norm and is_norm_candidate(module) and selected(name):
            try:
                norms[name] = norm_spec(module)
            except NotConvertible as err:
                entries[name] = Entry(name, "norm", was, "left alone", str(err))

    flow = dataflow.Flow()
    if example_input is None:
        for name in norms:
            flow.block(name, "no example input to trace its data flow (set example_input_array)")
    else:
        try:
            activation_modules = {
                m
                for m in named.values()
                if is_activation_candidate(m) or isinstance(m, (ReGELU2, ReSiLU2, GatedMLPBase))
            }
            flow = dataflow.trace(model, example_input, {n: named[n] for n in norms}, activation_modules)
        except Exception as err:  # noqa: BLE001 - a model that cannot run the example: convert no norm, measure nothing
            for name in norms:
                flow.block(name, f"probe forward failed ({type(err).__name__}: {err})")
            example_input = None
    for name, consumers in flow.consumers.items():
        excluded = [c for c in consumers if any(fnmatchcase(c, p) for p in exclude)]
        if excluded:
            flow.block(name, f"consumer {excluded[0]} is excluded")
        hooked = [c for c in consumers if not is_plain(named[c])]
        if hooked:
            flow.block(name, f"consumer {hooked[0]} has hooks or a patched forward")
    for where, ops in flow.functional.items():
        entries[f"{where}:{','.join(sorted(ops))}"] = Entry(
            where, "functional", "F." + "/F.".join(sorted(ops)), "left alone", "functional call inside forward"
        )

    before = after = None
    if example_input is not None and measure:
        before = _saved_bytes(model, example_input)
    reference = None
    if example_input is not None and verify:
        reference = flow.outputs if flow.outputs else _eval_outputs(model, example_input)

    surgery = _Surgery(model)
    try:
        consumers_of: dict[str, DeferredAffineNorm] = {}
        for name, kind in activations.items():
            surgery.replace(named[name], _NEW_ACTIVATION[kind](bits))
            new_name = _NEW_NAME[kind] if bits == 2 else f"{_NEW_NAME[kind]}, {bits}-bit"
            entries[name] = Entry(name, "activation", type(named[name]).__name__, "converted", new_name)
        for name, spec in norms.items():
            module = named[name]
            if name in flow.blocked:
                entries[name] = Entry(name, "norm", type(module).__name__, "left alone", flow.blocked[name])
                continue
            new = DeferredAffineNorm(
                spec.kind, spec.normalized_shape, spec.eps, module._parameters.get("weight"),
                module._parameters.get("bias"), type(module).__name__,
            )  # fmt: skip
            surgery.replace(module, new)
            consumers = sorted(flow.consumers[name])
            for linear_name in consumers:
                consumers_of[linear_name] = new
            entries[name] = Entry(name, "norm", type(module).__name__, "converted", _norm_detail(name, spec, consumers))
        for name, module in named.items():
            recast = do_linear and selected(name) and is_plain(module)
            if type(module) is nn.Linear and (name in consumers_of or recast):
                surgery.replace(module, LowMemLinear.from_linear(module, norm=consumers_of.get(name)))
                report.linears += 1
        for name, (layout, kind) in gated_mlps.items():
            new = fused_gated_mlp(named[name], layout, kind)  # the children as they are now (recast)
            surgery.replace(named[name], new)
            entries[name] = Entry(name, "gated MLP", type(named[name]).__name__, "converted", _gated_detail(kind, new))
        for module in model.modules():
            if _casts_itself(module):
                surgery.set(module, "cast_input_dtype_enabled", False)
        if reference is not None:
            _check_same(reference, _eval_outputs(model, example_input))
    except BaseException:
        surgery.rollback()
        raise
    if before is not None:
        after = _saved_bytes(model, example_input)

    order = {name: i for i, name in enumerate(named)}
    report.entries = sorted(entries.values(), key=lambda e: (order.get(e.name, len(order)), e.kind))
    report.saved_bytes_before, report.saved_bytes_after = before, after
    return report
