"""Kernel backends behind the low-memory ops, and which one runs.

Three implementations share one contract (see :mod:`.torch_ops`): ``"torch"`` (pure
PyTorch, always available), ``"cpp"`` (compiled CPU kernels) and ``"cuda"`` (compiled GPU
kernels), the compiled ones JIT-built from ``csrc/`` on first use (see :mod:`.build`).
By default CPU tensors run ``"cpp"`` and CUDA tensors ``"cuda"``; when an extension cannot
be built, a warning says why (once) and the pure-PyTorch path runs.
``LIGHTNING_LOWMEM_BACKEND=torch`` forces the reference everywhere; ``cpp`` (CPU tensors) and
``cuda`` (CUDA tensors) make a failed build an error, never a silent fallback.
"""

from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType

import torch

from lightning_lowmem.kernels import build, torch_ops

BACKENDS = ("torch", "cpp", "cuda")
ENV_VAR = "LIGHTNING_LOWMEM_BACKEND"
_EXTENSION_OF = {"cpp": "cpu", "cuda": "cuda"}  # backend name -> extension kind in build.py
_COMPILED_FOR = {"cpu": "cpp", "cuda": "cuda"}  # device type -> backend that compiles for it


def _forced() -> str | None:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


@functools.cache
def _warn_fallback(name: str, reason: str) -> None:
    warnings.warn(
        f"lightning_lowmem: the {name} kernels are unavailable ({reason}); using the pure-PyTorch "
        f"implementation. Set {ENV_VAR}=torch to silence this, or {ENV_VAR}={name} to make it an error.",
        RuntimeWarning,
        stacklevel=3,
    )


def backend(device: torch.device | str | None = None) -> str:
    """Name of the implementation that runs for tensors on ``device`` (default: CPU).

    The first call for a device type builds (or loads the cached build of) its extension.
    """
    device_type = torch.device(device if device is not None else "cpu").type
    forced = _forced()
    name = _COMPILED_FOR.get(device_type)
    if forced == "torch" or name is None:
        return "torch"
    loaded = build.load(_EXTENSION_OF[name])
    if isinstance(loaded, ModuleType):
        return name
    if forced == name:
        raise RuntimeError(f"{ENV_VAR}={name} was requested, but the {name} kernels cannot be used: {loaded}")
    _warn_fallback(name, str(loaded).splitlines()[0])
    return "torch"


def implementation(device: torch.device) -> ModuleType:
    """The module implementing the kernel contract for tensors on ``device``."""
    name = backend(device)
    return torch_ops if name == "torch" else build.load(_EXTENSION_OF[name])
