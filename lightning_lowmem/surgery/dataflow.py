"""Which linear layers read each norm's output? A probe forward on a real input answers it.

A memory-sharing norm returns the stock output to every reader, so converting one is always
correct; it saves memory where linear layers read that output and can save the norm's
normalized tensor instead. The probe tags each norm output and watches every torch function
call (a ``TorchFunctionMode``): a consumer is an exact ``nn.Linear`` module calling ``F.linear``
on that very tensor (a peft LoRA layer reads it through its ``base_layer`` and ``lora_A``, both
``nn.Linear``). Other readers (a residual add, a returned hidden state, a hook) are fine; a
norm with no consumer, or whose consumers read it through a LoRA dropout (a copy), is left
alone with the reason. The probe runs in train mode with gradients and in eval mode without,
so paths taken in only one mode are seen too; RNG and buffers are restored afterwards.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_lowmem.nn.peft import is_lora_layer, lora_dropouts
from lightning_lowmem.surgery.deferred import CallArgs

_METADATA = {
    "size", "dim", "numel", "stride", "is_contiguous", "element_size", "nelement", "is_floating_point",
    "get_device", "data_ptr", "__len__", "is_complex", "storage_offset",
    "shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "layout", "is_leaf", "grad_fn",
    "is_sparse", "is_meta", "is_nested", "is_quantized", "names", "is_mps",
}  # fmt: skip
_PASS_THROUGH = {"to", "contiguous", "type_as", "cpu", "cuda"}  # reads nothing when they return the input itself
_CASTS = {"to", "type_as"}
_FUNCTIONAL_ACTIVATIONS = {F.gelu: "gelu", F.silu: "silu"}


@dataclass
class Flow:
    """What the probe found: each norm's consumer linears, or the reason it is left alone.

    ``functional`` maps module names to GELU/SiLU functions called directly in their forward
    (not swappable); ``outputs`` are the model's eval-mode outputs, a reference for checks.
    """

    consumers: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    blocked: dict[str, str] = field(default_factory=dict)
    functional: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    outputs: list[torch.Tensor] = field(default_factory=list)

    def block(self, norm: str, reason: str) -> None:
        self.blocked.setdefault(norm, reason)


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    if name == "__get__":  # a property of Tensor, e.g. ``.shape``: name the property
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) model output: tensor, list, tuple, dict, HF ModelOutput."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for value in obj.values() for t in tensors_in(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in tensors_in(value)]
    return []


class _Probe(TorchFunctionMode):
    def __init__(
        self, flow: Flow, names: dict[nn.Module, str], stack: list[nn.Module], activations: set[nn.Module],
        dropouts: set[nn.Module],
    ) -> None:  # fmt: skip
        super().__init__()
        self.flow, self.names, self.stack, self.activations, self.dropouts = flow, names, stack, activations, dropouts
        self.tagged: dict[int, tuple[torch.Tensor, str]] = {}
        self.first_reader: dict[str, str] = {}  # norm -> its first reader that is no consumer

    def source(self, t: Any) -> str | None:
        entry = self.tagged.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is t else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        here = self.stack[-1] if self.stack else None
        where = self.names.get(here) or "<root>"
        name = _op_name(func)
        if func in _FUNCTIONAL_ACTIVATIONS and here not in self.activations:
            self.flow.functional[where].add(name)
        for t in tree_flatten((args, kwargs))[0]:
            norm = self.source(t)
            if norm is None or name in _METADATA or (name in _PASS_THROUGH and out is t):
                continue
            if name in _CASTS and is_lora_layer(here) and isinstance(out, torch.Tensor):
                # peft's cast of its input to the adapter dtype: the surgery switches it off (the converted
                # lora_A casts, saving the norm's tensor), so what the adapters read is the norm's output
                self.tagged[id(out)] = (out, norm)
                continue
            if func is F.linear and args and args[0] is t and type(here) is nn.Linear and args[1] is here.weight:
                self.flow.consumers[norm].add(where)
            elif here in self.dropouts:
                self.flow.block(
                    norm, f"its linear reader in {where.rpartition('.lora_dropout')[0]} reads a LoRA dropout copy"
                )
            else:
                self.first_reader.setdefault(norm, f"{name} in {where}")
        return out


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


@contextmanager
def isolated(model: nn.Module, train: bool) -> Iterator[None]:
    """Run a throwaway forward: same mode requested, RNG and buffers restored afterwards, and what it
    saves for backward hidden from any saved-tensor hooks around it (a SavedTensorMeter measuring the
    training step that triggered the surgery)."""
    was_training = model.training
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    devices = sorted({b.device.index for b in model.parameters() if b.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        model.train(train)
        try:
            with torch.set_grad_enabled(train), torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
                yield
        finally:
            model.train(was_training)
            with torch.no_grad():
                for name, b in model.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])


def call(model: nn.Module, example: Any) -> Any:
    """Call ``model`` the Lightning way: a tuple is positional args, a dict keyword args; a captured
    :class:`~.deferred.CallArgs` is replayed as it was made."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    to_device = partial(tree_map, lambda t: t.to(device) if isinstance(t, torch.Tensor) else t)
    if isinstance(example, CallArgs):
        return model.get_submodule(example.module)(*to_device(example.args), **to_device(example.kwargs))
    example = to_device(example)
    if isinstance(example, tuple):
        return model(*example)
    if isinstance(example, Mapping):
        return model(**example)
    return model(example)


def with_batch_size(example: Any, size: int) -> Any:
    """``example`` with ``size`` rows: its tensors' rows (dim 0) repeated or cut, as a bigger or smaller batch."""

    def resize(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        rows = torch.arange(size, device=value.device) % value.shape[0]
        return value.index_select(0, rows)  # a tensor of its own (a slice would keep a bigger storage)

    if isinstance(example, CallArgs):
        return CallArgs(tree_map(resize, example.args), tree_map(resize, example.kwargs), example.module)
    return tree_map(resize, example)


def describe(example: Any) -> str:
    """An example input in a line, e.g. ``model.backbone(tensor[8, 3, 32, 32], attention_mask=tensor[8, 16])``."""

    def show(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"tensor[{', '.join(map(str, value.shape))}]"
        return type(value).__name__

    if isinstance(example, CallArgs):
        args, kwargs, module = example.args, example.kwargs, example.module or "model"
    elif isinstance(example, tuple):
        args, kwargs, module = example, {}, "model"
    elif isinstance(example, Mapping):
        args, kwargs, module = (), example, "model"
    else:
        args, kwargs, module = (example,), {}, "model"
    parts = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()]
    return f"{module}({', '.join(parts)})"


def trace(model: nn.Module, example: Any, norms: dict[str, nn.Module], activations: set[nn.Module]) -> Flow:
    """Probe ``model`` on ``example`` (train and eval mode) and decide every norm in ``norms``."""
    flow = Flow()
    names = {module: name for name, module in model.named_modules()}
    by_module = {module: name for name, module in norms.items()}
    called: set[str] = set()
    stack: list[nn.Module] = []
    probe = _Probe(flow, names, stack, activations, set(lora_dropouts(model)))

    def pre(module, args):
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
            probe.tagged[id(output)] = (output, norm)

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
    finally:
        for handle in handles:
            handle.remove()

    for norm in norms:
        if norm not in called:
            flow.block(norm, "not called in the probe forward")
        elif not flow.consumers.get(norm):
            first = probe.first_reader.get(norm)
            flow.block(norm, "no linear layer reads its output" + (f" (first read by {first})" if first else ""))
    return flow
