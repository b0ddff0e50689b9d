"""Attention whose inputs are laid out to save less: LitGPT's ``CausalSelfAttention`` (its
``scaled_dot_product_attention``: :class:`~lightning_lowmem.nn.adapters.litgpt.AttentionLayout`), and a Hugging Face
model on SDPA (its config's attention implementation: :mod:`lightning_lowmem.nn.attention`), one entry per config."""

from __future__ import annotations

from torch import nn

from lightning_lowmem.nn import attention as hf_attention
from lightning_lowmem.nn.adapters import litgpt
from lightning_lowmem.surgery.changes import SetAttribute
from lightning_lowmem.surgery.families.base import Candidates, Family
from lightning_lowmem.surgery.report import Entry

_DETAIL = "v compact and q as (B, T, H, D): SDPA holds no qkv output, proj reads the output it saves"
_HF_DETAIL = "SDPA's query laid out (B, T, H, D): o_proj reads the output SDPA saves, not a copy"


def hf_config(module: nn.Module) -> object | None:
    """The config of a Hugging Face model on SDPA (or already on :data:`~lightning_lowmem.nn.attention.NAME`)."""
    config = getattr(module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    return config if implementation in ("sdpa", hf_attention.NAME) and hasattr(module, "get_input_embeddings") else None


class Attention(Family):
    kind = "attention"
    switch = "attention"
    separable = True

    def converted(self, module: nn.Module) -> bool:
        if hf_config(module) is not None:
            return hf_config(module)._attn_implementation == hf_attention.NAME
        return litgpt.attention_layout_of(module) is not None

    def nominate(self, model, options, found: Candidates) -> None:
        configs = set()
        for name, module in model.named_modules():
            if not (options.attention and options.selected(name)) or found.taken(name):
                continue
            config = hf_config(module)
            if config is not None and id(config) not in configs:
                configs.add(id(config))
                if self.converted(module):
                    found.already(name, self.kind, module)
                elif not hf_attention.attends_through_the_interface(_modeling(module)):
                    found.leave(name, self.kind, module, "its attention code tests for 'sdpa' itself: kept on SDPA")
                elif hf_attention.register():
                    found[self.kind][name] = module
            elif litgpt.is_attention(module):
                found[self.kind][name] = module

    def plan(self, model, found, flow, options, plan) -> None:
        for name, module in found[self.kind].items():
            if hf_config(module) is not None:
                plan.add(SetAttribute(hf_config(module), "_attn_implementation", hf_attention.NAME))
                plan.entries.append(Entry(name, self.kind, type(module).__name__, "converted", _HF_DETAIL))
                continue
            plan.install(module, "scaled_dot_product_attention", litgpt.AttentionLayout(module))
            plan.entries.append(Entry(name, self.kind, type(module).__name__, "converted", _DETAIL))


FAMILY = Attention()


def _modeling(module: nn.Module) -> nn.Module:
    """The Hugging Face model inside a peft wrapper (whose own class is peft's)."""
    get_base = getattr(module, "get_base_model", None)
    return get_base() if callable(get_base) else module
