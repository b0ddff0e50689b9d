"""The convert stage: apply a plan's replacements, and undo every change on any failure.

A replacement swaps a module object wherever it is held: in the model, and in the new
modules of the plan (a fused gated MLP holds the stock projections, which the plan replaces
too), so the order in which replacements are applied does not matter. In a model that FSDP2
already sharded, FSDP2's records of where it sets each parameter follow the replacement (:mod:`.fsdp`).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_lowmem.surgery import fsdp


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
        """Shadow a class attribute (a method) on the instance; rollback deletes the shadow (or puts back what the
        instance held, another library's patch)."""
        self.undo.append((obj, attr, vars(obj).get(attr, _SHADOWED)))
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
