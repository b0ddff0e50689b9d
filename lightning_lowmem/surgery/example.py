"""The example input the surgery runs on: how to call a model with it (also as a throwaway forward that
changes nothing), resize it, describe it.

An example is what Lightning's ``example_input_array`` holds (a tensor, a tuple of positional
arguments, or a dict of keyword arguments), or a :class:`CallArgs` captured from a real call (the
model's first training forward, :mod:`.deferred`), replayed as it was made.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_lowmem.nn.adapters.bitsandbytes import repacking_off


@dataclass(frozen=True)
class CallArgs:
    """A captured call: ``root.get_submodule(module)(*args, **kwargs)``."""

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    module: str = ""


@contextmanager
def probe_mode(model: nn.Module, train: bool) -> Iterator[None]:
    """The settings of a throwaway forward: every submodule in the mode asked for (each one's own flag back
    afterwards), grad only in training, and quantized weights left as they are (no repacking, see
    :func:`.bitsandbytes.repacking_4bit_layers`)."""
    flags = [(m, m.training) for m in model.modules()]
    model.train(train)
    try:
        with repacking_off(model), torch.set_grad_enabled(train):
            yield
    finally:
        for m, training in flags:
            m.training = training


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def _detached(t: torch.Tensor) -> torch.Tensor:
    """A saved tensor kept as is, but detached: a hook returning a saved output itself makes a cycle through the
    graph's C++ node that Python's collector cannot see (every probed model's tensors then lived on: the sweep's
    process grew by the model's size per conversion)."""
    return t.detach()


def gpus_of(model: nn.Module) -> list[int]:
    """The indices of the CUDA devices ``model``'s parameters are on (whose generators a probe or a conversion
    leaves as it found them)."""
    return sorted({t.device.index for t in model.parameters() if t.device.type == "cuda"})


@contextmanager
def isolated(model: nn.Module, train: bool) -> Iterator[None]:
    """Run a throwaway forward (:func:`probe_mode`): RNG and buffers restored afterwards, and what it
    saves for backward hidden from any saved-tensor hooks around it (a SavedTensorMeter measuring the
    training step that triggered the surgery). A buffer is restored as the object it was, with its values: a forward
    may update one in place (BatchNorm's statistics) or replace it (ConViT's ``rel_indices``, a cache made for the
    input's size, which a copy of the old values into would broadcast over)."""
    buffers = [
        (m, name, b, b.detach().clone()) for m in model.modules() for name, b in m._buffers.items() if b is not None
    ]
    with torch.random.fork_rng(devices=gpus_of(model)), probe_mode(model, train):
        try:
            with torch.autograd.graph.saved_tensors_hooks(_detached, _as_is):
                yield
        finally:
            with torch.no_grad():
                for module, name, buffer, values in buffers:
                    module._buffers[name] = buffer
                    buffer.copy_(values)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) model output: tensor, list, tuple, dict, HF ModelOutput."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for value in obj.values() for t in tensors_in(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in tensors_in(value)]
    return []


def loss_in(output: Any) -> torch.Tensor | None:
    """The loss a model returned (a Hugging Face output's ``loss``), or None."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def call(model: nn.Module, example: Any) -> Any:
    """Call ``model`` the Lightning way: a tuple is positional args, a dict keyword args; a captured
    :class:`CallArgs` is replayed as it was made."""
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


def batch_size(example: Any, owner: str) -> int:
    """The batch size of ``example``: dim 0 of its tensors, which must agree (a ValueError naming ``owner``)."""
    sizes = {t.shape[0] for t in tensors_in(example) if t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"{owner}: the example's tensors disagree on their batch size (dim 0): {sizes}")
    return sizes.pop()
