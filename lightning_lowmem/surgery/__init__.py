"""Model surgery: find activations, gated MLPs and norms in real models and convert them, verified."""

from lightning_lowmem.surgery.apply import apply_lowmem
from lightning_lowmem.surgery.report import Entry, LowMemReport

__all__ = ["Entry", "LowMemReport", "apply_lowmem"]
