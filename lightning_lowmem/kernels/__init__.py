"""Kernel backends behind the low-memory ops, and which one runs.

Four implementations compute the ops declared in :mod:`.torch_ops`: ``"torch"`` (the declarations' references,
pure PyTorch, always available), ``"cpp"`` (compiled CPU kernels), ``"cuda"`` (compiled GPU kernels), both
JIT-built from ``csrc/`` on first use (see :mod:`.build`) and run as the ``torch.ops.lowmem``
operators (see :mod:`.library`), and ``"triton"`` (GPU kernels that Triton, shipped with torch,
compiles at run time: no CUDA toolkit needed, see :mod:`.triton_ops`).
By default CPU tensors run ``"cpp"`` and CUDA tensors ``"cuda"`` (one path on every device: the compiled
kernels with their autograd in C++, launched as ATen launches its own; ``"triton"`` where no CUDA build can be
had, e.g. no nvcc); when nothing compiled can run, a warning says why (once) and the pure-PyTorch path runs. ``LIGHTNING_LOWMEM_BACKEND`` forces one:
``torch`` everywhere; ``cpp`` for CPU tensors and ``cuda`` for CUDA tensors (each leaves the
other device on its default); ``triton`` for CUDA tensors and, only under ``TRITON_INTERPRET=1``
(Triton's interpreter: the test mode), CPU tensors. A forced backend that cannot run is an error,
never a silent fallback. The variable is read when a device's backend is chosen: by its first op, and
again by every :func:`backend` call (the ops follow its answer).
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType
from typing import Any

import torch

from lightning_lowmem.kernels import build, library, torch_ops

BACKENDS = ("torch", "cpp", "cuda", "triton")
ENV_VAR = "LIGHTNING_LOWMEM_BACKEND"
_EXTENSION_OF = {"cpp": "cpu", "cuda": "cuda"}  # compiled backend -> extension kind in build.py
TRITON_MIN_CAPABILITY = (8, 0)  # the NVIDIA GPUs Triton supports


def _forced(setting: str | None) -> str | None:
    """The backend ``LIGHTNING_LOWMEM_BACKEND`` (its raw value ``setting``) forces, if any."""
    value = (setting or "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


@functools.cache
def _warn_fallback(names: str, reason: str) -> None:
    warnings.warn(
        f"lightning_lowmem: the {names} kernels are unavailable ({reason}); using the pure-PyTorch "
        f"implementation. Set {ENV_VAR}=torch to silence this, or {ENV_VAR}=<backend> to make it an error.",
        RuntimeWarning,
        stacklevel=3,
    )


@functools.cache
def _triton_module() -> ModuleType | ImportError:
    try:
        return importlib.import_module("lightning_lowmem.kernels.triton_ops")
    except ImportError as err:  # no triton (e.g. macOS, Windows) or one too old
        return err


def _triton_unusable(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run tensors on ``device``, or None when they can."""
    module = _triton_module()
    if isinstance(module, ImportError):
        return f"triton cannot be imported: {module}"
    if module.INTERPRETED:
        return None  # the interpreter runs CPU and CUDA tensors alike
    if device.type == "cpu":
        return "CPU tensors run only in Triton's interpreter: set TRITON_INTERPRET=1 before the first use"
    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    capability = torch.cuda.get_device_capability(device)
    if torch.version.hip is None and capability < TRITON_MIN_CAPABILITY:
        return f"the GPU has compute capability {capability[0]}.{capability[1]}, Triton needs 8.0 or newer"
    return None


def _unusable(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run tensors on ``device``, or None when it can."""
    if name == "triton":
        return _triton_unusable(device)
    loaded = build.load(_EXTENSION_OF[name])
    return str(loaded).splitlines()[0] if isinstance(loaded, build.BuildError) else None


def _candidates(device_type: str, forced: str | None) -> tuple[str, ...]:
    """The compiled backends to try for a device type, in order of preference."""
    if device_type == "cpu":
        return ("triton",) if forced == "triton" else ("cpp",)
    if device_type == "cuda":
        return (forced,) if forced in ("triton", "cuda") else ("cuda", "triton")
    return ()


def backend(device: torch.device | str | None = None) -> str:
    """Name of the implementation that runs for tensors on ``device`` (default: CPU).

    Chooses it now, reading ``LIGHTNING_LOWMEM_BACKEND``: the ops on the device run this choice from then
    on (the first op on a device makes one; set the variable before, or call this after changing it). The
    first call for a device type builds (or loads the cached build of) its extension.
    """
    return _choose_for(_device_name(torch.device(device if device is not None else "cpu")))


def _device_name(device: torch.device) -> str:
    """The name the ops look their device's choice up by: a tensor's device, so ``"cuda"`` is the current GPU's
    (``"cuda:0"``), never a key of its own that no tensor's ops would read."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


_CHOSEN: dict[str, str] = {}  # device name -> the backend its ops run: backend()'s last answer for it


@torch.compiler.assume_constant_result  # torch.compile runs it once, at trace time: no graph break
def _choose_for(device_name: str) -> str:
    _CHOSEN[device_name] = name = _choose(device_name, os.environ.get(ENV_VAR))
    return name


@torch.compiler.assume_constant_result
def _chosen(device_name: str) -> str:
    """The backend the ops on a device run, asked on every call: no environment read once chosen."""
    return _CHOSEN.get(device_name) or _choose_for(device_name)


_IMPLEMENTATIONS: dict[str, Any] = {"torch": torch_ops, "cpp": library.OPS, "cuda": library.OPS}
"""What implements the declared ops for each backend: the Triton operators are added when Triton is first usable, so
that :func:`implementation` is a lookup a trace reads, never an import it would trace."""


@functools.cache  # the answer for a device and setting is computed once (a build, a GPU query)
def _choose(device_name: str, setting: str | None) -> str:
    device = torch.device(device_name)
    forced = _forced(setting)
    candidates = () if forced == "torch" else _candidates(device.type, forced)
    reasons = []
    if "cuda" in candidates:  # the CUDA backend's heads run Triton's cross-entropy: defined before any trace
        _triton_operators(device)
    for name in candidates:
        reason = _unusable(name, device)
        if reason is None:
            if name == "triton":
                _triton_operators(device)
            return name
        if name == forced:
            raise RuntimeError(f"{ENV_VAR}={name} was requested, but the {name} kernels cannot be used: {reason}")
        reasons.append(f"{name}: {reason}" if len(candidates) > 1 else reason)
    if reasons:
        _warn_fallback(" and ".join(candidates), "; ".join(reasons))
    return "torch"


def _triton_operators(device: torch.device) -> Any | None:
    """The Triton kernels' operators (defined on first use) where they can run tensors on ``device``, else None."""
    if _triton_unusable(device) is not None:
        return None
    _IMPLEMENTATIONS["triton"] = operators = library.triton_operators(_triton_module())
    return operators


def implementation(device: torch.device) -> Any:
    """What implements the declared ops for tensors on ``device``: the ``torch.ops.lowmem`` operators for the
    compiled C++/CUDA kernels, ``torch.ops.lowmem_triton`` for Triton's, else the pure-PyTorch module."""
    return _IMPLEMENTATIONS[_chosen(_device_name(device))]


def head_implementation(device: torch.device) -> Any:
    """What runs a head's row ops (``cross_entropy_grad_``, ``token_log_probs``, ``token_log_probs_grad_``) for
    tensors on ``device``: :func:`implementation`, except that the CUDA C++ backend has no such kernels, so its heads
    run Triton's (where Triton can run; else the reference)."""
    name = _chosen(_device_name(device))
    if name == "cuda":
        return _IMPLEMENTATIONS.get("triton") or _triton_operators(device) or torch_ops
    return _IMPLEMENTATIONS[name]


def autograd_in_cpp(x: torch.Tensor) -> bool:
    """Whether eager calls on ``x`` take the operators with autograd in C++ (``ms_norm``, ``affine_linear``,
    ``step_activation``, see :mod:`.library`): where a compiled extension serves its device and nothing is
    being traced (torch.compile traces the Python autograd functions, which compute the same)."""
    # asked on every eager call: a CPU tensor's device name comes without making a device object and its string
    return not torch.compiler.is_compiling() and _chosen("cpu" if x.is_cpu else str(x.device)) in _EXTENSION_OF


def takes_host_side(x: torch.Tensor) -> bool:
    """Whether calls on ``x`` take the CPU's side where the ops differ by device (what a frozen norm saves, whether
    reading a value is free): the C++ kernels or the reference on a CPU tensor. Triton's interpreter on CPU tensors
    (``LIGHTNING_LOWMEM_BACKEND=triton TRITON_INTERPRET=1``) stands for a GPU and takes the GPU's side, so that a CPU
    test runs it."""
    return x.is_cpu and _chosen("cpu") != "triton"
