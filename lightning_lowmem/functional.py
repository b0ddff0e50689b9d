"""Functional API: ``regelu2``, ``resilu2``, ``ms_layer_norm``, ``ms_rms_norm``."""

from lightning_lowmem.ops import ms_layer_norm, ms_rms_norm, regelu2, resilu2

__all__ = ["ms_layer_norm", "ms_rms_norm", "regelu2", "resilu2"]
