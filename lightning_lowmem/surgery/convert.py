"""The changing phases of model surgery: apply a plan all or nothing, check, measure.

A replacement swaps a module object wherever it is held: in the model, and in the new
modules of the plan (a fused gated MLP holds the stock projections, which the plan replaces
too), so the order in which replacements are applied does not matter. In a model that FSDP2
already sharded, FSDP2's records of where it sets each parameter follow the replacement (:mod:`.fsdp`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.surgery import dataflow, fsdp


class Surgery:
    """Replacements, attribute changes and hooks done so far, undone in reverse by :meth:`rollback`."""

    def __init__(self, model: nn.Module, new_modules: Iterable[nn.Module] = ()) -> None:
        self.holders: dict[int, list[tuple[nn.Module, str]]] = {}  # id(child) -> every (parent, attribute)
        seen: set[int] = set()
        for root in (model, *new_modules):
            for parent in root.modules():
                if id(parent) in seen:
                    continue
                seen.add(id(parent))
                for attr, child in parent._modules.items():
                    if child is not None:
                        self.holders.setdefault(id(child), []).append((parent, attr))
        self.undo: list[tuple[object, str, object]] = []
        self.hooks: list[RemovableHandle] = []
        self.fsdp_records = fsdp.param_records(model)
        self.fsdp_groups: dict[int, object] = {}  # FSDP2 parameter groups whose records changed

    def replace(self, old: nn.Module, new: nn.Module) -> None:
        for parent, attr in self.holders.get(id(old), ()):
            self.set(parent, attr, new)
        for group, info in self.fsdp_records.get(id(old), ()):
            for attr, value in fsdp.repoint(info, old, new).items():
                self.set(info, attr, value)
            self.fsdp_groups[id(group)] = group
            fsdp.refresh_state_dict_hooks(group)

    def set(self, obj: object, attr: str, value: object) -> None:
        self.undo.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    def override(self, obj: object, attr: str, value: object) -> None:
        """Shadow a class attribute (a method) on the instance; rollback deletes the shadow."""
        self.undo.append((obj, attr, _SHADOWED))
        setattr(obj, attr, value)

    def keep_hooks(self, handles: Iterable[RemovableHandle]) -> None:
        self.hooks.extend(handles)

    def rollback(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        for obj, attr, value in reversed(self.undo):
            if value is _SHADOWED:
                delattr(obj, attr)
            else:
                setattr(obj, attr, value)
        self.undo.clear()
        for group in self.fsdp_groups.values():
            fsdp.refresh_state_dict_hooks(group)
        self.fsdp_groups.clear()


_SHADOWED = object()  # undo marker: the attribute was the class's


def measure_saved(model: nn.Module, example: Any) -> SavedTensorMeter:
    """What one training-mode forward on ``example`` saves for backward (RNG and buffers restored)."""
    with dataflow.isolated(model, train=True), SavedTensorMeter(model) as meter:
        dataflow.call(model, example)
    return meter


def eval_outputs(model: nn.Module, example: Any) -> list[torch.Tensor]:
    """The tensors of one eval-mode forward on ``example``, detached, in fp32."""
    with dataflow.isolated(model, train=False):
        return [t.detach().float() for t in dataflow.tensors_in(dataflow.call(model, example))]


def output_tolerance(model: nn.Module) -> float:
    """How close the converted model's outputs must be to the stock model's: 1e-4 where it computes in
    fp32/fp64, 5e-2 where half-precision parameters or autocast round every layer's output (the two
    models then differ by that rounding, both as close to an fp32 run)."""
    half = (torch.float16, torch.bfloat16)
    device_types = {p.device.type for p in model.parameters()} or {"cpu"}
    autocast = any(torch.amp.is_autocast_available(d) and torch.is_autocast_enabled(d) for d in device_types)
    return 5e-2 if autocast or any(p.dtype in half for p in model.parameters()) else 1e-4


def check_same(before: list[torch.Tensor], after: list[torch.Tensor], tolerance: float) -> None:
    """Raise unless the converted model's outputs equal the stock model's within ``tolerance`` (relative)."""
    if len(before) != len(after):
        raise RuntimeError(f"the converted model returns {len(after)} tensors instead of {len(before)}")
    for i, (a, b) in enumerate(zip(before, after)):
        scale = max(a.abs().max().item() if a.numel() else 0.0, 1.0)
        if a.shape != b.shape or not torch.allclose(a, b, rtol=tolerance, atol=tolerance * scale):
            diff = (a - b).abs().max().item() if a.shape == b.shape else "shape"
            raise RuntimeError(f"output {i} of the converted model differs from the stock model (max diff {diff})")
