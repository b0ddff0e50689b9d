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
from lightning_lowmem.kernels import library, torch_ops
from lightning_lowmem.registry.activations import GELU_2BIT

triton = pytest.importorskip("triton")
triton_ops = pytest.importorskip("lightning_lowmem.kernels.triton_ops")
from lightning_lowmem.kernels import triton_aot


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the tests run compiled Triton")
def test_this_test_process_runs_triton_in_its_interpreter(monkeypatch):
    """tests/conftest.py sets TRITON_INTERPRET=1 before Triton defines any kernel: CPU tensors then run."""
    assert os.environ["TRITON_INTERPRET"] == "1" and triton_ops.INTERPRETED
    assert not isinstance(triton_ops._gated_backward_kernel, triton.runtime.JITFunction)
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    operators = library.triton_operators(triton_ops)
    assert kernels.backend("cpu") == "triton" and kernels.implementation(torch.device("cpu")) is operators
    x = torch.randn(37)
    assert torch.equal(triton_ops.act_codes(x, GELU_2BIT.thresholds), torch_ops.act_codes(x, GELU_2BIT.thresholds))


def _without_interpreter(module: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m module args`` in a fresh process without TRITON_INTERPRET: Triton's own compiled kernels."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=Path(__file__).resolve().parents[1], env=environment,
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def test_without_the_interpreter_cpu_tensors_are_a_clear_error():
    out = _without_interpreter("tests.triton_compiled", **{kernels.ENV_VAR: "triton"})
    assert out.returncode == 0, out.stderr[-3000:]
    backend_error, kernel_error = json.loads(out.stdout.strip().splitlines()[-1])["refusals"]
    assert "LIGHTNING_LOWMEM_BACKEND=triton was requested" in backend_error and "TRITON_INTERPRET=1" in backend_error
    assert kernel_error.startswith("act_codes: ") and "Triton's interpreter" in kernel_error


@pytest.mark.slow
def test_every_kernel_configuration_compiles_for_every_target_without_spills(tmp_path):
    """Ahead-of-time compilation of every configuration the launchers can choose, for sm_80, sm_90, sm_100 and
    sm_120: catches what the interpreter lets through (types, loop-carried values, ops without a GPU lowering,
    compiler crashes, register spills) before a GPU ever sees the kernels."""
    report_path = tmp_path / "aot.json"
    out = _without_interpreter("lightning_lowmem.kernels.triton_aot", "--json", str(report_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["targets"] == list(triton_aot.TARGETS) and {80, 90} <= set(report["targets"])
    kernels_defined = {name for name in dir(triton_ops) if name.endswith("_kernel") and not name.startswith("__")}
    assert {config["kernel"] for config in report["configurations"]} == kernels_defined
    assert len(report["results"]) == len(report["configurations"]) * len(report["targets"])
    assert [r for r in report["results"] if not r["ok"] or r["spill_bytes"]] == []
    norm_blocks = {c["constexprs"]["BLOCK"] for c in report["configurations"] if c["kernel"] == "_norm_backward_kernel"}
    assert triton_ops.MAX_NORM_BLOCK in norm_blocks and triton_ops.MIN_ROW_BLOCK in norm_blocks


@pytest.mark.slow
def test_a_compiler_crash_fails_its_configuration_and_the_rest_still_compile():
    """tests/triton_sm90_crash.py: the kernel shape Triton 3.8 crashes on for sm_90 (sm_80 compiles it). The build
    reports that configuration as crashed and compiles the next. When the crash is gone, a newer Triton compiles
    it: ``_norm_backward_kernel`` may keep block-wide accumulators again."""
    crash = {
        "module": "tests.triton_sm90_crash", "kernel": "kernel", "constexprs": {"BLOCK": 4096}, "num_warps": 8,
        "signature": {"g_ptr": "*fp32", "z_ptr": "*fp32", "out_ptr": "*fp32", "dim": "i32", "BLOCK": "constexpr"},
    }  # fmt: skip
    plain = next(c for c in triton_aot.configurations() if c["kernel"] == "_dropout_kernel")
    results = triton_aot.compile_configs([crash, plain, crash], [80, 90])
    assert [(r["index"], r["target"], r["ok"]) for r in results] == [
        (0, 80, True), (0, 90, False), (1, 80, True), (1, 90, True), (2, 80, True), (2, 90, False)
    ]  # fmt: skip
    assert results[1]["error"].startswith("compiler crashed"), "Triton now compiles it for sm_90"
