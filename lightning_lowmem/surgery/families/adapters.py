"""Layers of adapter libraries (:mod:`lightning_lowmem.nn.adapters`): each library's adapter says where the layer's
dropouts fold, whether a forward is installed on it (LitGPT's LoRA layers: :class:`~lightning_lowmem.nn.adapters.
litgpt.LoRAForward`), whether it shares a norm's tensor as a whole (frozen 4-bit layers), and what to set once
its children are replaced (peft's input cast). Plain linear layers are :mod:`.linears`'.
"""

from __future__ import annotations

from torch import nn

from lightning_lowmem.nn.adapters import ForwardAdapter, LinearAdapter, adapter_of
from lightning_lowmem.surgery.changes import SetAttribute
from lightning_lowmem.surgery.families.base import Candidates, Family, foldable
from lightning_lowmem.surgery.identify import is_plain
from lightning_lowmem.surgery.report import Entry


def _detail(adapter: LinearAdapter, norm: nn.Module | None, p: float) -> str:
    saves = "the norm's z" if norm is not None else "its input"
    folded = f", its dropout folded (p={p:g})" if p else ""
    return f"{adapter.name} forward: the adapter's x @ A.T saves {saves}, never a dropped copy{folded}"


def _child(layer: nn.Module, path: str) -> nn.Module | None:
    try:
        return layer.get_submodule(path)
    except AttributeError:
        return None


class Adapters(Family):
    kind = "LoRA"
    switch = "lora"

    def converted(self, module: nn.Module) -> bool:
        adapter = adapter_of(module)
        return adapter is not None and adapter.installed(module)

    def nominate(self, model, options, found: Candidates) -> None:
        layers = found[self.kind]  # layers whose forward is installed -> the dropout it takes in
        for name, layer in model.named_modules():
            adapter = adapter_of(layer)
            if adapter is None or adapter.generic or found.already_converted(name):
                continue
            installs = isinstance(adapter, ForwardAdapter)
            if installs and options.lora and options.selected(name) and is_plain(layer):
                layers[name] = 0.0
                found.linear_readers.add(name)
            elif not installs and adapter.reads_linearly(layer):
                found.linear_readers.add(name)
            for fold in adapter.folds(layer):
                self._fold(name, layer, fold, options, found)

    def _fold(self, name: str, layer: nn.Module, fold, options, found: Candidates) -> None:
        dropout_name = f"{name}.{fold.dropout}"
        found.adapter_dropouts.add(dropout_name)
        if not options.dropout or not options.selected(dropout_name):
            return
        dropout = layer.get_submodule(fold.dropout)
        if fold.refused is not None:
            found.leave(dropout_name, "dropout", dropout, fold.refused)
        elif fold.by_forward:
            if name in found[self.kind] and is_plain(dropout):
                found[self.kind][name] = fold.p
                found.folded[dropout_name] = (f"{name}.{fold.into}", fold.p)
        elif foldable(dropout, _child(layer, fold.into)):
            found.folded[dropout_name] = (f"{name}.{fold.into}", fold.p)
        else:
            found.leave(
                dropout_name,
                "dropout",
                dropout,
                f"its {fold.into.split('.')[0]} is no plain linear layer to take it in",
            )

    def plan(self, model, found, flow, options, plan) -> None:
        for name, layer in model.named_modules():
            adapter = adapter_of(layer)
            if adapter is None or adapter.generic:
                continue
            if name in found[self.kind]:
                p, norm = found[self.kind][name], plan.norm_of.get(name)
                plan.install(layer, "forward", adapter.forward(layer, norm, p))
                plan.entries.append(
                    Entry(name, self.kind, type(layer).__name__, "converted", _detail(adapter, norm, p))
                )
            for attr, value in adapter.after_conversion(layer, plan.replaced).items():
                plan.add(SetAttribute(layer, attr, value))


FAMILY = Adapters()
