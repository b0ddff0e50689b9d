"""Activation-memory measurement."""

from lightning_lowmem.memory.saved_tensors import SavedStorage, SavedTensorMeter

__all__ = ["SavedStorage", "SavedTensorMeter"]
