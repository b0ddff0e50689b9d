"""LitGPT's attention (``CausalSelfAttention``): its ``scaled_dot_product_attention`` gets its inputs laid out to
save less (:class:`~lightning_lowmem.nn.adapters.litgpt.AttentionLayout`)."""

from __future__ import annotations

from torch import nn

from lightning_lowmem.nn.adapters import litgpt
from lightning_lowmem.surgery.families.base import Candidates, Family
from lightning_lowmem.surgery.report import Entry

_DETAIL = "v compact and q as (B, T, H, D): SDPA holds no qkv output, proj reads the output it saves"


class Attention(Family):
    kind = "attention"
    switch = "attention"
    separable = True

    def converted(self, module: nn.Module) -> bool:
        return litgpt.attention_layout_of(module) is not None

    def nominate(self, model, options, found: Candidates) -> None:
        for name, module in model.named_modules():
            if options.attention and litgpt.is_attention(module) and options.selected(name) and not found.taken(name):
                found[self.kind][name] = module

    def plan(self, model, found, flow, options, plan) -> None:
        for name, module in found[self.kind].items():
            plan.install(module, "scaled_dot_product_attention", litgpt.AttentionLayout(module))
            plan.entries.append(Entry(name, self.kind, type(module).__name__, "converted", _DETAIL))


FAMILY = Attention()
