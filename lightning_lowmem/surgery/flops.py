"""The FLOPs a forward would run on a GPU, counted on any device: torch's FLOP counter knows the ops CUDA runs
(``mm``, flash / memory-efficient attention) but not the ones the CPU runs in their place, bitsandbytes' fused 4-bit
matmul (on CUDA: dequantize, then ``mm``) and the CPU's flash attention; and before torch 2.14 its attention formula
refuses grouped-query attention (keys and values with fewer heads than the queries). Without them a QLoRA block's or
an SDPA block's recompute cost would be its adapters' alone. Attention counts as torch counts it: every query
against every key, causal or not, each query head against its group's key and value head.
"""

from __future__ import annotations

import math
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten
ATTENTION = (  # (query, key, value, ...) -> output
    aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
)  # fmt: skip
ATTENTION_BACKWARD = (  # (grad_out, query, key, value, ...) -> gradients
    aten._scaled_dot_product_flash_attention_for_cpu_backward, aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward, aten._scaled_dot_product_cudnn_attention_backward,
)  # fmt: skip


def flop_counter() -> FlopCounterMode:
    """A quiet FLOP counter that also counts the CPU's stand-ins and grouped-query attention (see the module
    docstring); torch's own registry is left as it is."""
    mapping = {op: _attention for op in ATTENTION} | {op: _attention_backward for op in ATTENTION_BACKWARD}
    if "bitsandbytes" in sys.modules and hasattr(torch.ops.bitsandbytes, "gemm_4bit"):  # loaded by the model's code
        mapping[torch.ops.bitsandbytes.gemm_4bit] = _gemm_4bit
    return FlopCounterMode(display=False, custom_mapping=mapping)


def _per_query_head(query: list[int], key: list[int], value: list[int]) -> tuple[list[int], ...]:
    """Key and value shapes with the query's heads (dim 1): grouped-query attention runs each query head against its
    group's key and value head."""
    return query, [key[0], query[1], *key[2:]], [value[0], query[1], *value[2:]]


def _attention(query: list[int], key: list[int], value: list[int], *args: object, **kwargs: object) -> int:
    return sdpa_flop_count(*_per_query_head(query, key, value))


def _attention_backward(
    grad_out: list[int], query: list[int], key: list[int], value: list[int], *args: object, **kwargs: object
) -> int:
    return sdpa_backward_flop_count(grad_out, *_per_query_head(query, key, value))


def _gemm_4bit(a_shape: list[int], b_shape: list[int], shape_b: list[int], *args: object, **kwargs: object) -> int:
    """A (..., in) times the (out, in) weight: 2 FLOPs a multiply-add."""
    return 2 * math.prod(a_shape) * shape_b[0]
