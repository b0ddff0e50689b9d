"""Model surgery: find activations, gated MLPs, norms, dropouts, LoRA layers and heads in real models and convert
them, verified.

The public surface: :func:`apply_lowmem` / :func:`plan` / :func:`max_batch_size` with their
:class:`Options`, the :class:`LowMemReport`, and what an integration needs to convert at a model's
first training forward (:func:`convert_at_first_forward`, :class:`CallArgs`, :class:`ExampleInputError`).
"""

from lightning_lowmem.surgery.apply import apply_lowmem, max_batch_size, plan
from lightning_lowmem.surgery.budget import BudgetPlan
from lightning_lowmem.surgery.deferred import convert_at_first_forward
from lightning_lowmem.surgery.example import CallArgs
from lightning_lowmem.surgery.options import Options, takes_options
from lightning_lowmem.surgery.probe import ExampleInputError
from lightning_lowmem.surgery.report import Entry, LowMemReport

__all__ = [
    "BudgetPlan",
    "CallArgs",
    "Entry",
    "ExampleInputError",
    "LowMemReport",
    "Options",
    "apply_lowmem",
    "convert_at_first_forward",
    "max_batch_size",
    "plan",
    "takes_options",
]
