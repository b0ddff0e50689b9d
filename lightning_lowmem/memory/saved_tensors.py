"""Measure activation memory: the bytes autograd keeps alive for backward.

Every tensor saved for backward passes through ``torch.autograd.graph.saved_tensors_hooks``.
The meter counts each *storage* once (a tensor shared by two ops, e.g. an MS norm's
output and the next linear's input, is one storage), skips parameters and buffers, and
tracks how many bytes the graph holds at any moment, so it reports both the total saved by
a forward and the peak held. It tells apart the copies of parameters in another dtype that
autocast makes for each linear (they do not grow with the batch) from activations proper. Stock dropout is
measured as a GPU keeps it (see :func:`dropout_as_on_a_gpu`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

MIB = float(1 << 20)
OBSERVER = "_lowmem_observer"  # marks module hooks that only watch: replacing the module loses nothing


def observer(hook):
    """``hook``, marked as one that only watches (model surgery may replace the module it is on)."""
    setattr(hook, OBSERVER, True)
    return hook


@contextmanager
def dropout_as_on_a_gpu() -> Iterator[None]:
    """``F.dropout`` (``nn.Dropout`` calls it) on CPU tensors as ``torch.native_dropout``, which keeps a bool mask for
    backward, as CUDA's fused dropout does: CPU's own keeps its mask in the input's dtype (4 B an element for
    fp32), which would overstate what a stock model keeps on a GPU. Same distribution, scaling and gradient."""
    stock = F.dropout

    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or inplace or p in (0, 1) or input.device.type != "cpu":
            return stock(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = stock


@dataclass(frozen=True)
class SavedStorage:
    """One storage that became held by the autograd graph."""

    module: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    weight_copy: bool = False  # a parameter cast to another dtype (autocast's weight copies)


class _Held:
    """What the graph holds instead of the tensor; releases the meter's count when freed."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: tuple, meter: SavedTensorMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr())


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds: a ``DTensor``'s local shard (FSDP2's sharded parameters)."""
    return t.to_local() if isinstance(t, DTensor) else t


class SavedTensorMeter:
    """Context manager counting unique storages saved for backward.

    Args:
        model: parameters and buffers of this model are excluded (every ``nn.Parameter`` and
            views of one are always excluded); its submodules are used for the per-module
            breakdown, attributing a saved storage to the innermost module running when it
            was first saved.
        gpu_dropout: run stock dropout as a GPU does while measuring (:func:`dropout_as_on_a_gpu`); ``False``
            measures this device's own (what a training step here really keeps).

    Example::

        with SavedTensorMeter(model) as meter:
            loss = model(x).sum()
        print(meter.total_bytes, meter.table())
        loss.backward()  # peak_bytes stays valid; live_bytes drops to 0
    """

    def __init__(self, model: nn.Module | None = None, gpu_dropout: bool = True) -> None:
        self.model = model
        self._dropout = dropout_as_on_a_gpu() if gpu_dropout else None
        self.records: list[SavedStorage] = []
        self.total_bytes = 0
        self.weight_copy_bytes = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[tuple, int] = {}
        self.storages: set[tuple] = set()  # (device, data pointer) of every storage counted
        self._sizes: dict[tuple, int] = {}
        self._excluded: set[tuple] = set()
        self._parameters_by_shape: dict[tuple[int, ...], list[tuple[nn.Module, str]]] = defaultdict(list)
        self._module_stack: list[str] = []
        self._module_hooks: list = []
        self._graph_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> Self:
        if self.model is not None:
            tensors = [*self.model.parameters(), *self.model.buffers()]
            self._excluded = {_storage_key(_local(t)) for t in tensors}
            for module in self.model.modules():
                for name, parameter in module._parameters.items():
                    if parameter is not None:
                        self._parameters_by_shape[tuple(parameter.shape)].append((module, name))
            leave = observer(lambda module, args, output: self._leave_module())
            for name, module in self.model.named_modules():
                self._module_hooks.append(module.register_forward_pre_hook(self._enter_module(name)))
                self._module_hooks.append(module.register_forward_hook(leave, always_call=True))
        if self._dropout is not None:
            self._dropout.__enter__()
        self._graph_hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._graph_hooks.__exit__(*exc)
        if self._dropout is not None:
            self._dropout.__exit__(*exc)
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks.clear()
        self._module_stack.clear()

    def _enter_module(self, name: str):
        @observer
        def hook(module, args):
            self._module_stack.append(name or "<root>")

        return hook

    def _leave_module(self) -> None:
        if self._module_stack:
            self._module_stack.pop()

    # -- autograd hooks --------------------------------------------------------------------
    def _is_parameter(self, t: torch.Tensor) -> bool:
        return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or _storage_key(t) in self._excluded

    def _is_weight_copy(self, t: torch.Tensor) -> bool:
        """``t`` (or the tensor it is a view of: a linear saves its weight transposed) equals a parameter of
        the model cast to ``t``'s dtype; only parameters of the same shape are compared. A parameter is looked up
        where it is registered when ``t`` is saved: FSDP2 puts the gathered parameter there for the forward."""
        base = t if t._base is None else t._base
        current = (
            module._parameters.get(name) for module, name in self._parameters_by_shape.get(tuple(base.shape), ())
        )
        candidates = [p for p in current if p is not None and not isinstance(p, DTensor) and p.dtype != base.dtype]
        with torch.no_grad():
            return any(p.device == base.device and torch.equal(p.to(base.dtype), base) for p in candidates)

    def _pack(self, t: torch.Tensor):
        if self._is_parameter(t):
            return t
        key = _storage_key(t)
        if self._refs.get(key, 0) == 0:
            nbytes = t.untyped_storage().nbytes()
            self._sizes[key] = nbytes
            self.live_bytes += nbytes
            self.total_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weight_copy = self._is_weight_copy(t)
            self.weight_copy_bytes += nbytes if weight_copy else 0
            module = self._module_stack[-1] if self._module_stack else "<outside>"
            self.records.append(SavedStorage(module, tuple(t.shape), t.dtype, nbytes, weight_copy))
            self.storages.add(key)
        self._refs[key] = self._refs.get(key, 0) + 1
        return _Held(t.detach(), key, self)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: tuple) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live_bytes -= self._sizes.pop(key)

    # -- reports ---------------------------------------------------------------------------
    @property
    def activation_bytes(self) -> int:
        """Bytes saved less autocast's weight copies: what grows with the batch."""
        return self.total_bytes - self.weight_copy_bytes

    @property
    def by_module(self) -> dict[str, int]:
        """Bytes first saved while each module (innermost, by qualified name) was running."""
        totals: dict[str, int] = defaultdict(int)
        for record in self.records:
            totals[record.module] += record.nbytes
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def table(self, top: int | None = 20) -> str:
        """A plain-text breakdown: the modules holding the most activation memory."""
        rows = list(self.by_module.items())[:top]
        width = max([len("module"), *(len(name) for name, _ in rows)])
        lines = [f"{'module':<{width}}  {'MiB':>10}  {'share':>6}"]
        for name, nbytes in rows:
            share = 100.0 * nbytes / self.total_bytes if self.total_bytes else 0.0
            lines.append(f"{name:<{width}}  {nbytes / MIB:>10.3f}  {share:>5.1f}%")
        lines.append(
            f"{'total':<{width}}  {self.total_bytes / MIB:>10.3f}  (peak held {self.peak_bytes / MIB:.3f} MiB)"
        )
        return "\n".join(lines)
