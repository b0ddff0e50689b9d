"""Autograd ops: the bottom layer, on top of the kernel backends."""

from lightning_lowmem.ops.activation import regelu2, resilu2, step_activation
from lightning_lowmem.ops.affine import affine_linear
from lightning_lowmem.ops.cross_entropy import linear_cross_entropy
from lightning_lowmem.ops.dropout import seeded_dropout
from lightning_lowmem.ops.gated import gated_activation
from lightning_lowmem.ops.log_probs import linear_log_probs
from lightning_lowmem.ops.norm import ms_layer_norm, ms_rms_norm

__all__ = [
    "affine_linear",
    "gated_activation",
    "linear_cross_entropy",
    "linear_log_probs",
    "ms_layer_norm",
    "ms_rms_norm",
    "regelu2",
    "resilu2",
    "seeded_dropout",
    "step_activation",
]
