"""Linear layers: each norm's consumers share its tensor, a folded dropout moves in, and every other linear layer
recasts its weight in backward (no half-precision weight copy saved under autocast).

Which modules are linear layers is verified (:class:`~lightning_lowmem.surgery.identify.LinearLayers`: ``nn.Linear``,
Falcon's ``FalconLinear``, GPT-2's transposed ``Conv1D``); they keep their Parameter objects and names.
"""

from __future__ import annotations

from lightning_lowmem.nn import LowMemLinear, LowMemTransposedLinear
from lightning_lowmem.surgery.families.base import Candidates, Family
from lightning_lowmem.surgery.identify import LinearKind, LinearLayers, is_plain

LOW_MEMORY_LINEARS: dict[LinearKind, type[LowMemLinear | LowMemTransposedLinear]] = {
    cls.linear_kind: cls for cls in (LowMemLinear, LowMemTransposedLinear)
}


class Linears(Family):
    kind = "linear"
    switch = "linear"

    def nominate(self, model, options, found: Candidates) -> None:
        linear_layers = LinearLayers()
        for name, module in model.named_modules():
            low_memory = isinstance(module, tuple(LOW_MEMORY_LINEARS.values()))
            kind = module.linear_kind if low_memory else linear_layers.kind(module)
            if kind is not None:
                found[self.kind][name] = kind

    def plan(self, model, found, flow, options, plan) -> None:
        named = dict(model.named_modules())
        folded = found.takes_dropout()
        for name, kind in found[self.kind].items():
            module = named[name]
            recasts = isinstance(module, tuple(LOW_MEMORY_LINEARS.values()))  # converted by an earlier run
            if recasts and module.norm is not None and name not in folded:
                continue  # an earlier run's norm consumer
            recast = options.linear and options.selected(name) and is_plain(module) and not recasts
            if name in plan.norm_of or name in folded or recast:
                norm = plan.norm_of.get(name, module.norm if recasts else None)
                dropout = {"dropout": folded[name]} if name in folded else {}  # LowMemLinear's alone: nn.Linear's
                plan.replace(module, LOW_MEMORY_LINEARS[kind].from_linear(module, norm, **dropout))
                plan.linears += not recasts


FAMILY = Linears()
