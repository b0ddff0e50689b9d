"""Hugging Face attention on SDPA, its query laid out as its output should be: the attention implementation
``lowmem_sdpa`` (:data:`NAME`), registered with transformers' ``AttentionInterface`` (and SDPA's mask).

transformers hands ``o_proj`` ``attn_output.transpose(1, 2).contiguous()`` of SDPA's output, and SDPA returns its
output in its query's memory layout. Where the query arrives ``(B, H, T, D)``-contiguous (Phi-3's partial RoPE
concatenates it so), that ``.contiguous()`` is a copy, which ``o_proj`` (its LoRA adapter, or a trained weight)
saves beside the output SDPA saves itself: one activation per layer twice. Here the query goes in as a
``(B, T, H, D)`` layout (same values; the ``(B, H, T, D)`` one is freed), the output comes back in it, and
``o_proj`` reads a view of what SDPA saves. A query already in that layout (LLaMA's RoPE keeps its projection's)
goes in as it is.
"""

from __future__ import annotations

import inspect
import sys
from functools import cache
from typing import Any

import torch
from torch import nn

NAME = "lowmem_sdpa"


def sdpa_in_output_layout(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention (``sdpa_attention_forward``), the query laid out ``(B, T, H, D)`` first."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.dim() == 4 and query.shape[2] > 1 and query.is_contiguous():
        query = query.transpose(1, 2).contiguous().transpose(1, 2)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> bool:
    """Make :data:`NAME` an attention implementation transformers knows, with SDPA's masks; ``False`` where
    transformers has no ``AttentionInterface`` (before 4.48)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:
        return False
    AttentionInterface.register(NAME, sdpa_in_output_layout)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return True


def attends_through_the_interface(model: nn.Module) -> bool:
    """Whether ``model``'s modeling code picks its attention from transformers' ``ALL_ATTENTION_FUNCTIONS`` and never
    tests for ``"sdpa"`` itself (Falcon's does, and takes another path for any other name). The modeling code is
    that of the model's own class, under any class torch's wrappers make (FSDP2's ``FSDPLlamaForCausalLM``)."""
    own = next((c for c in type(model).__mro__ if not c.__module__.startswith("torch.")), type(model))
    return _attends_through_the_interface(own.__module__)


@cache
def _attends_through_the_interface(module_name: str) -> bool:
    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source and '"sdpa"' not in source and "'sdpa'" not in source
