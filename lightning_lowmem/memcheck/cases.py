"""The project's reference cases: a timm ViT and a LLaMA-style decoder, small enough for CI.

Every model is built with and without LowMemBP (``apply_lowmem``), under fp32 and bf16, with
Lightning's own precision plugin (``stock``) and with ``LowMemPrecision``, so the gate guards
each part's contribution; the LLaMA also with the common LoRA recipe (``lora_dropout=0.05``), with and without
``labels`` (the model's own loss: the fused head).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_lowmem.memcheck import Case


def vit() -> tuple[nn.Module, Any]:
    """timm ViT-Ti/16 geometry (192 wide, 3 heads), 2 blocks, 8 images of 96x96 (37 tokens)."""
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=96, depth=2, num_classes=10)
    return model, torch.randn(8, 3, 96, 96)


def llama() -> tuple[nn.Module, Any]:
    """A 2-layer LLaMA (hidden 128, GQA 4/2 heads, SwiGLU 344), 4 sequences of 128 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(config), {"input_ids": torch.randint(0, 512, (4, 128))}


def llama_lora_dropout() -> tuple[nn.Module, Any]:
    """The LLaMA above with peft LoRA (r 8) on every linear layer and ``lora_dropout=0.05``."""
    from peft import LoraConfig, get_peft_model

    model, batch = llama()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=targets)), batch


def llama_lora_labels() -> tuple[nn.Module, Any]:
    """The LoRA LLaMA above called as a causal LM is trained: with ``labels``, the model computing its loss."""
    model, batch = llama_lora_dropout()
    return model, {**batch, "labels": batch["input_ids"]}


# (name, lowmem, plugin, precisions)
_METHODS = (
    ("stock", False, "stock", ("32-true", "bf16-mixed", "bf16-true")),
    ("lowmem-precision", False, "lowmem", ("bf16-mixed", "bf16-true")),
    ("lowmem", True, "lowmem", ("32-true", "bf16-mixed", "bf16-true")),
)

CASES = [
    Case(f"{build.__name__}/{method}/{precision}", build, precision, lowmem, plugin)
    for build in (vit, llama)
    for method, lowmem, plugin, precisions in _METHODS
    for precision in precisions
] + [
    Case(f"{build.__name__}/{method}/bf16-mixed", build, "bf16-mixed", lowmem, plugin)
    for build in (llama_lora_dropout, llama_lora_labels)
    for method, lowmem, plugin, _ in _METHODS
]
