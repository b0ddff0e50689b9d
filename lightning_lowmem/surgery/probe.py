"""Which layers read each norm's output? A probe forward on a real input answers it.

A memory-sharing norm returns the stock output to every reader, so converting one is always
correct; it saves memory where linear layers read that output and can save the norm's
normalized tensor instead. The probe tags each norm output and records every read of it, in
order (:class:`Read`): a module called on it (module hooks), or a torch function reading it
outside such a module (a ``TorchFunctionMode``): a residual add, a slice, or ``F.linear`` with
another module's weight (timm's BEiT attention reads its ``qkv`` weight so). Views of whole rows
of it (``hidden[:, 0]`` for a pooler, ``hidden.view(-1, n)``) are followed: a linear layer reading
one can share too. Which reads are linear layers that share is the plan's question (:mod:`.plan`);
a norm read through a LoRA dropout (a copy) is left alone here, with the reason. The probe runs
in train mode with gradients and in eval mode without, so paths taken in only one mode are seen
too; RNG and buffers are restored afterwards.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_lowmem.nn.adapters import adapter_of
from lightning_lowmem.nn.linear import linear_arguments
from lightning_lowmem.nn.norm import whole_rows
from lightning_lowmem.registry.activations import FUNCTIONS
from lightning_lowmem.surgery.example import call, isolated, tensors_in

_METADATA = {
    "size", "dim", "numel", "stride", "is_contiguous", "element_size", "nelement", "is_floating_point",
    "get_device", "data_ptr", "__len__", "is_complex", "storage_offset",
    "shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "layout", "is_leaf", "grad_fn",
    "is_sparse", "is_meta", "is_nested", "is_quantized", "names", "is_mps",
}  # fmt: skip
_PASS_THROUGH = {"to", "contiguous", "type_as", "cpu", "cuda"}  # reads nothing when they return the input itself
_CASTS = {"to", "type_as"}


def _is_functional_candidate(func: Any, args: tuple, kwargs: dict) -> bool:
    """An activation of the registry, or a training dropout (``F.dropout``, SDPA's ``dropout_p``), called as a
    function: the report says so where the surgery does not rewrite it."""
    if func in FUNCTIONS:
        return True
    if func is F.dropout:
        bound = dict(zip(("input", "p", "training"), args)) | kwargs
        return bound.get("training", True) and bound.get("p", 0.5) > 0
    if func is F.scaled_dot_product_attention:
        return kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0) > 0
    return False


# how the report words a read
_READ_AS = {
    "__getitem__": "an index or slice", "add": "an add", "__add__": "an add", "__radd__": "an add", "mul": "a product",
    "__mul__": "a product", "__rmul__": "a product", "dropout": "a dropout", "view": "a reshape",
    "reshape": "a reshape", "matmul": "a matmul", "__matmul__": "a matmul", "linear": "F.linear",
    "mul_": "an in-place product", "__imul__": "an in-place product", "add_": "an in-place add",
    "__iadd__": "an in-place add",
}  # fmt: skip


@dataclass(frozen=True)
class Read:
    """One read of a norm's output: the module ``where`` called on it (``op`` is ``None``), or torch
    function ``op`` in ``where``; ``weight_of`` names the module whose weight ``F.linear`` used."""

    where: str
    kind: str  # the class of the module ``where``
    op: str | None = None
    weight_of: str | None = None

    def describe(self) -> str:
        """In the user's words: ``Conv1D transformer.h.0.attn.c_attn``, ``an add in Gemma2DecoderLayer model.layers.0``."""
        module = f"{self.kind} {self.where}" if self.where else self.kind
        return module if self.op is None else f"{_READ_AS.get(self.op, self.op)} in {module}"


@dataclass
class Flow:
    """What the probe found: each norm's reads in order, or the reason it is left alone.

    ``functional`` maps module names to the activation functions and training dropouts called directly in their
    forward (reported where not rewritten); ``outputs`` are the model's eval-mode outputs, a reference for checks.
    """

    reads: dict[str, list[Read]] = field(default_factory=lambda: defaultdict(list))
    consumers: dict[str, list[str]] = field(default_factory=dict)  # decided by the plan from the reads
    functional_callers: dict[str, list[str]] = field(default_factory=dict)  # norm -> modules calling F.linear on it
    blocked: dict[str, str] = field(default_factory=dict)
    functional: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    outputs: list[torch.Tensor] = field(default_factory=list)

    def block(self, norm: str, reason: str) -> None:
        self.blocked.setdefault(norm, reason)

    def read(self, norm: str, read: Read) -> None:
        if read not in self.reads[norm]:
            self.reads[norm].append(read)


def _passes_casts(module: nn.Module | None) -> bool:
    adapter = adapter_of(module)
    return adapter is not None and adapter.passes_casts(module)


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    if name == "__get__":  # a property of Tensor, e.g. ``.shape``: name the property
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class _Probe(TorchFunctionMode):
    def __init__(
        self, flow: Flow, names: dict[nn.Module, str], stack: list[nn.Module], activations: set[nn.Module],
        copying: set[nn.Module], passing: set[nn.Module], row_shapes: dict[str, tuple[int, ...]],
    ) -> None:  # fmt: skip
        super().__init__()
        self.flow, self.names, self.stack, self.activations = flow, names, stack, activations
        self.copying, self.passing = copying, passing  # LoRA dropouts that stay; the dropouts the surgery converts
        self.row_shapes = row_shapes
        self.tagged: dict[int, tuple[torch.Tensor, str, torch.Tensor]] = {}  # id -> (tensor, norm, norm's output)
        self.called_on: dict[int, set[nn.Module]] = defaultdict(set)  # id(tagged tensor) -> modules called on it
        self.owner = {id(p): self.names[m] for m in names for p in m.parameters(recurse=False)}

    def tag(self, output: torch.Tensor, norm: str) -> None:
        self.tagged[id(output)] = (output, norm, output)

    def source(self, t: Any) -> str | None:
        entry = self.tagged.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is t else None

    def follow_views(self, t: torch.Tensor, out: Any) -> None:
        """Tag the views of whole rows of ``t``'s norm output among ``out``: a linear layer reading one shares too."""
        _, norm, root = self.tagged[id(t)]
        for view in tree_flatten(out)[0]:
            if isinstance(view, torch.Tensor) and view._base is root and whole_rows(view, root, self.row_shapes[norm]):
                self.tagged[id(view)] = (view, norm, root)

    def module_called(self, module: nn.Module, args: tuple) -> None:
        norm = self.source(args[0]) if args else None
        if norm is not None:
            self.called_on[id(args[0])].add(module)
            self.flow.read(norm, Read(self.names[module], type(module).__name__))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        here = self.stack[-1] if self.stack else None
        where = self.names.get(here, "")
        name = _op_name(func)
        if here not in self.activations and _is_functional_candidate(func, args, kwargs):
            self.flow.functional[where or "<root>"].add(name)
        for t in tree_flatten((args, kwargs))[0]:
            norm = self.source(t)
            if norm is None or name in _METADATA or (name in _PASS_THROUGH and out is t):
                continue
            if isinstance(out, torch.Tensor) and (
                (name in _CASTS and _passes_casts(here)) or (here in self.passing and func is F.dropout)
            ):
                # peft's cast of its input to the adapter dtype, which the surgery switches off (the converted
                # lora_A casts, saving the norm's tensor), or a dropout the surgery converts (folded into a LoRA
                # adapter's lora_A, or seeded: its readers save the norm's z and its seed): what its readers read
                # is, for the plan, the norm's output
                self.tagged[id(out)] = (out, norm, self.tagged[id(t)][2])
                continue
            self.follow_views(t, out)
            x, weight, _ = linear_arguments(args, kwargs) if func is F.linear else (None, None, None)
            weight_of = self.owner.get(id(weight)) if x is t and isinstance(weight, nn.Parameter) else None
            kind = type(here).__name__ if here is not None else "model"
            if here in self.copying:
                layer = where.rpartition(".lora_dropout")[0]
                self.flow.block(norm, f"its linear reader in {layer} reads a LoRA dropout copy")
            elif weight_of not in (None, where) or here not in self.called_on[id(t)]:
                # reads inside a module called on it are that module's, but for F.linear with another's weight
                self.flow.read(norm, Read(where, kind, name, weight_of))
            if out is t and name.endswith("_"):  # changed in place: no longer gamma * z + beta for later readers
                del self.tagged[id(t)]
        return out


def _trace(
    model: nn.Module,
    example: Any,
    norms: dict[str, tuple[nn.Module, tuple[int, ...]]],
    activations: set[nn.Module],
    passing: set[nn.Module],
    copying: set[nn.Module],
) -> Flow:
    """Probe ``model`` on ``example`` (train and eval mode) and record the reads of every norm in ``norms``
    (name -> module and normalized shape)."""
    flow = Flow()
    names = {module: name for name, module in model.named_modules()}
    by_module = {module: name for name, (module, _) in norms.items()}
    called: set[str] = set()
    stack: list[nn.Module] = []
    row_shapes = {name: shape for name, (_, shape) in norms.items()}
    probe = _Probe(flow, names, stack, activations, copying, passing, row_shapes)

    def pre(module, args):
        probe.module_called(module, args)
        stack.append(module)

    def post(module, args, output):
        stack.pop()
        norm = by_module.get(module)
        if norm is None:
            return
        called.add(norm)
        if not isinstance(output, torch.Tensor):
            flow.block(norm, "output is not a single tensor")
        else:
            probe.tag(output, norm)

    handles = []
    for module in names:
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    try:
        for train in (True, False):
            with isolated(model, train), probe:
                outputs = call(model, example)
            flow.outputs = [t.detach().float() for t in tensors_in(outputs)]
            del outputs
            probe.tagged.clear()
            probe.called_on.clear()
    finally:
        for handle in handles:
            handle.remove()

    for norm in norms:
        if norm not in called:
            flow.block(norm, "not called in the probe forward")
    return flow


class ExampleInputError(RuntimeError):
    """The model fails on the example input (the model's own error is the cause); nothing was changed."""


def probe(
    model: nn.Module,
    example: Any,
    norms: dict[str, tuple[int, ...]],
    activations: set[nn.Module],
    passing: set[nn.Module] = frozenset(),
    copying: set[nn.Module] = frozenset(),
) -> Flow:
    """The probe stage: every read of the output of each norm in ``norms`` (name -> normalized shape), and the
    activation functions and training dropouts called in modules other than ``activations``; the dropouts the
    surgery converts (``passing``) pass the norm's output on to their readers, and a norm read through an adapter's
    dropout that stays (``copying``) is left alone. Without an example every norm is
    left alone; an example the model cannot run is an :class:`ExampleInputError`."""
    if example is None:
        flow = Flow()
        for name in norms:
            flow.block(name, "no example input to trace its data flow (set example_input_array)")
        return flow
    named = dict(model.named_modules())
    try:
        norms_by_name = {name: (named[name], shape) for name, shape in norms.items()}
        return _trace(model, example, norms_by_name, activations, set(passing), set(copying) - set(passing))
    except Exception as err:
        raise ExampleInputError(
            f"apply_lowmem: {type(model).__name__} cannot run the example input ({type(err).__name__}: {err}); "
            "nothing was changed"
        ) from err
