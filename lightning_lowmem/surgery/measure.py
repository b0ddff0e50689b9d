"""The measure stage: what one training forward saves for backward, the figure the report gives."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.surgery.example import call, isolated


def measure_saved(model: nn.Module, example: Any) -> SavedTensorMeter:
    """What one training-mode forward on ``example`` saves for backward (RNG and buffers restored)."""
    with isolated(model, train=True), SavedTensorMeter(model) as meter:
        call(model, example)
    return meter
