"""The peak of memory allocated while a function runs, from the profiler's allocation events (CPU tensors): what
saved-tensor hooks cannot see, such as what a checkpointed region recomputes in backward, or a backward's
temporary gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile


def allocation_peak(fn: Callable[[], Any]) -> tuple[int, Any]:
    """The most bytes allocated at once while ``fn()`` runs, above what was allocated when it started (each
    operator's own allocations and frees, in the order they began), and ``fn``'s result."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak, result
