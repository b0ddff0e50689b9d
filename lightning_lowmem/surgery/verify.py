"""The verify stage: the converted model computes what the stock model computed, within its dtype's rounding."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_lowmem.surgery.example import call, isolated, tensors_in


def eval_outputs(model: nn.Module, example: Any) -> list[torch.Tensor]:
    """The tensors of one eval-mode forward on ``example``, detached, in fp32."""
    with isolated(model, train=False):
        return [t.detach().float() for t in tensors_in(call(model, example))]


def output_tolerance(model: nn.Module) -> float:
    """How close the converted model's outputs must be to the stock model's: 1e-4 where it computes in
    fp32/fp64, 5e-2 where half-precision parameters or autocast round every layer's output (the two
    models then differ by that rounding, both as close to an fp32 run)."""
    half = (torch.float16, torch.bfloat16)
    device_types = {p.device.type for p in model.parameters()} or {"cpu"}
    autocast = any(torch.amp.is_autocast_available(d) and torch.is_autocast_enabled(d) for d in device_types)
    return 5e-2 if autocast or any(p.dtype in half for p in model.parameters()) else 1e-4


def check_same(before: list[torch.Tensor], after: list[torch.Tensor], tolerance: float) -> None:
    """Raise unless the converted model's outputs equal the stock model's within ``tolerance`` (relative)."""
    if len(before) != len(after):
        raise RuntimeError(f"the converted model returns {len(after)} tensors instead of {len(before)}")
    for i, (a, b) in enumerate(zip(before, after)):
        scale = max(a.abs().max().item() if a.numel() else 0.0, 1.0)
        if a.shape != b.shape or not torch.allclose(a, b, rtol=tolerance, atol=tolerance * scale):
            diff = (a - b).abs().max().item() if a.shape == b.shape else "shape"
            raise RuntimeError(f"output {i} of the converted model differs from the stock model (max diff {diff})")


def verify(model: nn.Module, example: Any, reference: list[torch.Tensor]) -> None:
    """Raise unless the (converted) model's eval outputs on ``example`` equal ``reference``, the stock model's."""
    check_same(reference, eval_outputs(model, example), output_tolerance(model))
