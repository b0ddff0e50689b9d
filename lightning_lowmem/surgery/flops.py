"""The FLOPs a forward would run on a GPU, counted on any device: torch's FLOP counter knows the ops CUDA runs
(``mm``, flash / memory-efficient attention) but not the ones the CPU runs in their place, bitsandbytes' fused 4-bit
matmul (on CUDA: dequantize, then ``mm``) and the CPU's flash attention. Without them a QLoRA block's or an SDPA
block's recompute cost would be its adapters' alone. Attention counts as torch counts it: every query against every
key, causal or not.
"""

from __future__ import annotations

import math
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula

aten = torch.ops.aten


def flop_counter() -> FlopCounterMode:
    """A quiet FLOP counter that also counts the CPU's stand-ins (see the module docstring)."""
    cpu_attention = {
        aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
    }
    for op, as_on_cuda in cpu_attention.items():  # the same leading arguments: query, key, value (grad_out first)
        flop_registry.setdefault(op, flop_registry[as_on_cuda])
    loaded = "bitsandbytes" in sys.modules and hasattr(torch.ops.bitsandbytes, "gemm_4bit")  # by the model's code
    if loaded and torch.ops.bitsandbytes.gemm_4bit not in flop_registry:
        register_flop_formula(torch.ops.bitsandbytes.gemm_4bit)(_gemm_4bit_flops)
    return FlopCounterMode(display=False)


def _gemm_4bit_flops(
    a_shape: list[int], b_shape: list[int], shape_b: list[int], *args: object, **kwargs: object
) -> int:
    """A (..., in) times the (out, in) weight: 2 FLOPs a multiply-add."""
    return 2 * math.prod(a_shape) * shape_b[0]
