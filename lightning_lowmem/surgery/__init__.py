"""Model surgery: find activations and norms in real models and convert them, verified."""

from lightning_lowmem.surgery.apply import Entry, LowMemReport, apply_lowmem
from lightning_lowmem.surgery.modules import DeferredAffineNorm, LowMemLinear

__all__ = ["DeferredAffineNorm", "Entry", "LowMemLinear", "LowMemReport", "apply_lowmem"]
