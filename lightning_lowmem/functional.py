"""Functional API: ``regelu2``, ``resilu2``, ``ms_layer_norm``, ``ms_rms_norm``, ``gated_activation``."""

from lightning_lowmem.ops import gated_activation, ms_layer_norm, ms_rms_norm, regelu2, resilu2

__all__ = ["gated_activation", "ms_layer_norm", "ms_rms_norm", "regelu2", "resilu2"]
