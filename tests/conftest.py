"""Shared fixtures: deterministic seeds, a recorder of what autograd saves, the compiled kernel backends.

Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter. Triton reads
``TRITON_INTERPRET`` when a kernel is defined, i.e. when ``lightning_lowmem.kernels.triton_ops`` is
first imported (on first use of the Triton backend, never at package import), so setting it here,
before any test runs, is enough; with a GPU it stays unset and the kernels compile and run there.

``ATEN_CPU_CAPABILITY=avx2`` on an AVX512 machine stands for an AVX2 machine only with two more settings
(:mod:`benchmarks.forced_capability`), made here before torch is imported.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from benchmarks.forced_capability import emulate

emulate()
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2`: a worker per core, each (and what it starts) one thread
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from typing import Self

import pytest
import torch

HAS_GPU = torch.cuda.is_available()


def _interpreter_rounds_bf16_to_nearest_even() -> None:
    """Triton's interpreter truncates fp32 -> bf16, where compiled Triton (like torch) rounds to nearest
    even: make it round like the GPU, so that the interpreted kernels can be checked bit for bit."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter._convert_float

    def convert(values, input_dtype, output_dtype, rounding_mode):
        to_bf16 = input_dtype == tl.float32 and output_dtype == tl.bfloat16
        if to_bf16 and rounding_mode != interpreter._ir.ROUNDING_MODE.RTZ:
            as_float = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
            return as_float.to(torch.bfloat16).view(torch.uint16).numpy()
        return truncating(values, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert


if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        _interpreter_rounds_bf16_to_nearest_even()
    except ImportError:  # no triton on this platform: its tests skip
        pass


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_backend_choice():
    """The backend chosen for a device is kept for the process; tests that fake a failed build or a GPU must
    not leave their choice to the next test."""
    from lightning_lowmem import kernels

    kernels._choose.cache_clear()
    kernels._CHOSEN.clear()
    yield
    kernels._choose.cache_clear()
    kernels._CHOSEN.clear()


class SavedRecorder:
    """Records every tensor autograd saves inside the ``with`` block (no dedup, no filtering)."""

    def __init__(self) -> None:
        self.saved: list[torch.Tensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.append(t)
        return t

    def __enter__(self) -> Self:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def storages(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in self.saved}


@pytest.fixture
def recorder() -> type[SavedRecorder]:
    return SavedRecorder


class KernelBackend(NamedTuple):
    """A compiled backend under test: its name, the device its tensors live on, what implements the declared ops
    (the ``torch.ops.lowmem_triton`` operators of the Triton kernels, or the ``torch.ops.lowmem`` operators for the
    C++ and CUDA extensions)."""

    name: str
    device: str
    module: Any


def _load_backend(name: str, device: str) -> KernelBackend:
    from lightning_lowmem import kernels
    from lightning_lowmem.kernels import build, library

    if name == "triton":
        module = kernels._triton_module()
        if isinstance(module, ImportError):
            pytest.skip(f"triton cannot be imported here: {module}")
        if device == "cpu" and not module.INTERPRETED:
            pytest.skip("the Triton kernels run on CPU tensors only in Triton's interpreter (TRITON_INTERPRET=1)")
        return KernelBackend(name, device, library.triton_operators(module))  # as the ops call them
    loaded = build.load("cpu" if name == "cpp" else "cuda")
    if isinstance(loaded, build.BuildError):
        pytest.fail(f"the {name} extension must build here: {loaded}")
    return KernelBackend(name, device, library.OPS)  # the dispatcher runs the extension's kernels


_GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no GPU")]
KERNEL_BACKENDS = [
    pytest.param(("cpp", "cpu"), id="cpp"),
    pytest.param(("cuda", "cuda"), id="cuda", marks=_GPU),
    pytest.param(("triton", "cpu"), id="triton-interpreter"),
    pytest.param(("triton", "cuda"), id="triton-cuda", marks=_GPU),
]


@pytest.fixture(params=KERNEL_BACKENDS)
def kernel_backend(request) -> KernelBackend:
    """Each compiled backend on its device: C++ on CPU, CUDA C++ and Triton on a GPU, Triton interpreted on CPU."""
    return _load_backend(*request.param)


def run_on(monkeypatch: pytest.MonkeyPatch, backend: KernelBackend) -> None:
    """The ops run ``backend`` (a ``kernel_backend``) from now on."""
    from lightning_lowmem import kernels

    monkeypatch.setenv(kernels.ENV_VAR, backend.name)
    assert kernels.backend(backend.device) == backend.name


def run_ddp_script(tmp_path, template: str, **fields: Any) -> Any:
    """Run a Lightning 2-process DDP script in a fresh interpreter and return the JSON it wrote to ``{out}``.

    ``template`` is formatted with ``fields`` plus ``out``, ``root`` (``tmp_path``) and ``tests`` (this folder,
    also on the path). The script ends by destroying the process group and leaves without the interpreter's
    shutdown (``os._exit`` once its output is flushed): gloo's worker threads still holding tensors at shutdown
    abort the process (SIGABRT, "terminate called without an active exception", pytorch/pytorch#179291),
    intermittently, after a run that succeeded; destroying the group alone left 1 run in 6 aborting here."""
    import json
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    out, path = tmp_path / "ddp.json", tmp_path / "ddp_run.py"
    text = textwrap.dedent(template).format(out=str(out), root=str(tmp_path), tests=str(tests), **fields)
    ending = (  # the script's own run: not where torch.multiprocessing's spawned children import it
        '\nif __name__ == "__main__":\n'
        "    if torch.distributed.is_initialized():\n        torch.distributed.destroy_process_group()\n"
        "    import os as _os, sys as _sys\n    _sys.stdout.flush()\n    _sys.stderr.flush()\n    _os._exit(0)\n"
    )
    path.write_text(text + ending)
    env = {k: v for k, v in os.environ.items() if k.startswith(("LIGHTNING_LOWMEM", "HOME", "TMP"))}
    env.update(PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests)]), PATH="/usr/bin:/bin")
    subprocess.run([sys.executable, str(path)], check=True, cwd=tmp_path, env=env, timeout=300)
    return json.loads(out.read_text())
