"""Activation modules (GELU erf/tanh, SiLU, QuickGELU, Mish, registered classes): the k-bit step backward.

An activation inside a gated MLP that fuses is that MLP's (claimed); a leaf that computes a registry activation
although nothing names it is reported with the registration that would convert it.
"""

from __future__ import annotations

from torch import nn

from lightning_lowmem.nn import LowMemActivation
from lightning_lowmem.surgery.families.base import ROOT, Candidates, Family
from lightning_lowmem.surgery.identify import NotConvertible, activation_of, names_activation, unnamed_activation
from lightning_lowmem.surgery.report import Entry


class Activations(Family):
    kind = "activation"
    switch = "activation"
    separable = True

    def converted(self, module: nn.Module) -> bool:
        return isinstance(module, LowMemActivation)

    def nominate(self, model, options, found: Candidates) -> None:
        for name, module in model.named_modules():
            if found.taken(name) or not options.selected(name):
                continue
            if names_activation(module):
                if module is model:
                    found.leave(name, self.kind, module, ROOT)
                elif options.activation:
                    try:
                        found[self.kind][name] = activation_of(module).name
                    except NotConvertible as err:
                        found.leave(name, self.kind, module, str(err))
            elif options.activation and (unnamed := unnamed_activation(module)) is not None:
                cls = type(module).__name__
                found.leave(name, self.kind, module, (
                    f"computes {unnamed.label}, but neither its class name nor a registration says so: "
                    f"lightning_lowmem.register_activation({cls}, like={unnamed.name!r}) converts it"
                ))  # fmt: skip

    def plan(self, model, found, flow, options, plan) -> None:
        named = dict(model.named_modules())
        for name, activation in found[self.kind].items():
            new = LowMemActivation.create(activation, options.bits)
            plan.replace(named[name], new)
            plan.entries.append(Entry(name, self.kind, type(named[name]).__name__, "converted", new.label))


FAMILY = Activations()
