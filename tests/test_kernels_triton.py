"""The Triton backend's own guarantees: how the test process runs it, what it refuses, and that every kernel
compiles for a GPU. Its numerics run in the shared kernel matrix (the ``kernel_backend`` fixture of
conftest.py): without a GPU, in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_lowmem import kernels
from lightning_lowmem.kernels import torch_ops
from lightning_lowmem.registry.activations import GELU_2BIT

triton = pytest.importorskip("triton")
triton_ops = pytest.importorskip("lightning_lowmem.kernels.triton_ops")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the tests run compiled Triton")
def test_this_test_process_runs_triton_in_its_interpreter(monkeypatch):
    """tests/conftest.py sets TRITON_INTERPRET=1 before Triton defines any kernel: CPU tensors then run."""
    assert os.environ["TRITON_INTERPRET"] == "1" and triton_ops.INTERPRETED
    assert not isinstance(triton_ops._gated_backward_kernel, triton.runtime.JITFunction)
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    assert kernels.backend("cpu") == "triton" and kernels.implementation(torch.device("cpu")) is triton_ops
    x = torch.randn(37)
    assert torch.equal(triton_ops.act_codes(x, GELU_2BIT.thresholds), torch_ops.act_codes(x, GELU_2BIT.thresholds))


@pytest.fixture(scope="module")
def compiled_triton() -> dict:
    """What tests/triton_compiled.py reports from a process without TRITON_INTERPRET, Triton forced."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {kernels.ENV_VAR: "triton"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.triton_compiled"],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_the_interpreter_cpu_tensors_are_a_clear_error(compiled_triton):
    backend_error, kernel_error = compiled_triton["refusals"]
    assert "LIGHTNING_LOWMEM_BACKEND=triton was requested" in backend_error and "TRITON_INTERPRET=1" in backend_error
    assert kernel_error.startswith("act_codes: ") and "Triton's interpreter" in kernel_error


@pytest.mark.slow
def test_every_kernel_compiles_for_a_gpu(compiled_triton):
    """Ahead-of-time compilation of every launch variant to sm_90: catches what the interpreter lets through
    (types, loop-carried values, ops without a GPU lowering) before a GPU ever sees the kernels."""
    assert compiled_triton["failures"] == []
    assert set(compiled_triton["compiled"]) == {
        "_act_codes_kernel", "_act_backward_kernel", "_norm_forward_kernel", "_norm_backward_kernel",
        "_gated_backward_kernel", "_dropout_kernel", "_cross_entropy_grad_kernel",
    }  # fmt: skip
