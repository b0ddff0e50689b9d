"""Model surgery: find activations, gated MLPs and norms in real models and convert them, verified."""

from lightning_lowmem.surgery.apply import apply_lowmem, max_batch_size, plan
from lightning_lowmem.surgery.budget import BudgetPlan
from lightning_lowmem.surgery.report import Entry, LowMemReport

__all__ = ["BudgetPlan", "Entry", "LowMemReport", "apply_lowmem", "max_batch_size", "plan"]
