"""Activation-memory measurement."""

from lightning_lowmem.memory.saved_tensors import MIB, SavedStorage, SavedTensorMeter

__all__ = ["MIB", "SavedStorage", "SavedTensorMeter"]
