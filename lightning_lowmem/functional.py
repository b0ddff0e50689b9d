"""Functional API: the low-memory autograd ops."""

from lightning_lowmem.ops import (
    affine_linear,
    gated_activation,
    ms_layer_norm,
    ms_rms_norm,
    regelu2,
    resilu2,
    step_activation,
)

__all__ = [
    "affine_linear",
    "gated_activation",
    "ms_layer_norm",
    "ms_rms_norm",
    "regelu2",
    "resilu2",
    "step_activation",
]
