"""Dropouts: a model's own ``nn.Dropout`` becomes a seeded dropout that saves its seed, not its mask; a dropout
another family folds into the linear computation reading it (a LoRA adapter's, T5's product dropout) becomes
``nn.Identity`` (the reader takes it in), unless that reader finds it where it is (a rewritten forward's)."""

from __future__ import annotations

from torch import nn

from lightning_lowmem.nn import SeededDropout
from lightning_lowmem.registry.dropouts import is_elementwise_dropout
from lightning_lowmem.surgery.families.base import Candidates, Family
from lightning_lowmem.surgery.identify import is_plain
from lightning_lowmem.surgery.report import Entry


def _relative(name: str, to: str) -> str:
    """``name`` without the module path it shares with ``to`` (``q_proj.lora_A.default`` seen from
    ``q_proj.lora_dropout.default``: ``lora_A.default``)."""
    parts, base = name.split("."), to.split(".")
    common = next((i for i, (a, b) in enumerate(zip(parts, base)) if a != b), min(len(parts), len(base)))
    return ".".join(parts[common:])


class Dropouts(Family):
    kind = "dropout"
    switch = "dropout"

    def converted(self, module: nn.Module) -> bool:
        return isinstance(module, SeededDropout)

    def nominate(self, model, options, found: Candidates) -> None:
        if not options.dropout:
            return
        for name, module in model.named_modules():
            if found.taken(name) or not options.selected(name) or not is_elementwise_dropout(module) or module.p == 0:
                continue
            if is_plain(module):
                found[self.kind][name] = module.p
            else:
                found.leave(name, self.kind, module, "has hooks or a patched forward (a replacement would drop them)")

    def plan(self, model, found, flow, options, plan) -> None:
        named = dict(model.named_modules())
        entry = lambda name, detail: Entry(name, self.kind, type(named[name]).__name__, "converted", detail)
        for name, p in found[self.kind].items():
            plan.replace(named[name], SeededDropout.from_module(named[name]))
            plan.entries.append(entry(name, f"seeded (p={p:g}): saves its seed, not its mask"))
        for name, (layer, p) in found.folded.items():
            if name not in found.kept_in_place:
                plan.replace(named[name], nn.Identity())
            detail = (
                f"folded into {_relative(layer, name)} (p={p:g}): it saves its input and a seed, not a dropped copy"
            )
            plan.entries.append(entry(name, detail))


FAMILY = Dropouts()
