"""Gated MLP modules (LLaMA's, timm's SwiGLU / GluMlp, T5's): one fused, exact ``act(gate) * up``.

They go first: the activation inside a gated MLP that fuses is the MLP's, not a candidate of its own; a dropout
between the product and the layer reading it (T5's) folds into that layer.
"""

from __future__ import annotations

from torch import nn

from lightning_lowmem.nn import GatedMLPBase
from lightning_lowmem.registry.activations import ACTIVATIONS
from lightning_lowmem.surgery.families.base import ROOT, Candidates, Family, foldable
from lightning_lowmem.surgery.identify import NotConvertible, fused_gated_mlp, gated_layout
from lightning_lowmem.surgery.report import Entry


def _detail(new: GatedMLPBase) -> str:
    """E.g. ``SwiGLU fused, saves gate (+ the product its down projection saves)``."""
    saves = "gate (+ the product its down projection saves)" if new.resolved_mode() == "gate" else "gate and up"
    return f"{ACTIVATIONS[new.activation].gated} fused, saves {saves}"


class GatedMLPs(Family):
    kind = "gated MLP"
    switch = "gated"
    separable = True

    def converted(self, module: nn.Module) -> bool:
        return isinstance(module, GatedMLPBase)

    def nominate(self, model, options, found: Candidates) -> None:
        for name, module in model.named_modules():
            match = gated_layout(module) if options.gated and options.selected(name) else None
            if match is None or found.taken(name):
                continue
            if module is model:
                found.leave(name, self.kind, module, ROOT)
                continue
            try:
                with found.gathered(name):
                    found[self.kind][name] = fused = fused_gated_mlp(module, *match)
                if options.gated == "exact":  # saves gate and up whatever reads the product
                    fused.mode = "gate_up"
            except NotConvertible as err:
                found.leave(name, self.kind, module, str(err))
                continue
            found.claimed.add(f"{name}.{match[0].activation}")
            between = fused.product_dropout() if options.dropout else None
            if between is not None and foldable(*(module._modules[child] for child in between)):
                found.folded[f"{name}.{between[0]}"] = (f"{name}.{between[1]}", module._modules[between[0]].p)

    def plan(self, model, found, flow, options, plan) -> None:
        named = dict(model.named_modules())
        for name, fused in found[self.kind].items():
            plan.replace(named[name], fused)
            plan.entries.append(Entry(name, self.kind, type(named[name]).__name__, "converted", _detail(fused)))


FAMILY = GatedMLPs()
