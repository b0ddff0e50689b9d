"""Kernel backends behind the low-memory ops, and which one runs.

Three implementations share one contract (see :mod:`.torch_ops`): ``"torch"`` (pure
PyTorch, always available), ``"cpp"`` (compiled CPU kernels) and ``"cuda"`` (compiled GPU
kernels). ``LIGHTNING_LOWMEM_BACKEND=torch|cpp|cuda`` forces one; forcing one that cannot
run is an error, never a silent fallback.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from lightning_lowmem.kernels import torch_ops

BACKENDS = ("torch", "cpp", "cuda")
ENV_VAR = "LIGHTNING_LOWMEM_BACKEND"


def _forced() -> str | None:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def backend(device: torch.device | str | None = None) -> str:
    """Name of the implementation that runs for tensors on ``device`` (default: CPU)."""
    forced = _forced()
    if forced is not None and forced != "torch":
        raise RuntimeError(
            f"{ENV_VAR}={forced} was requested, but this build of lightning_lowmem ships no compiled "
            "kernels yet; unset it or use 'torch'"
        )
    return "torch"


def implementation(device: torch.device) -> ModuleType:
    """The module implementing the kernel contract for tensors on ``device``."""
    backend(device)
    return torch_ops
