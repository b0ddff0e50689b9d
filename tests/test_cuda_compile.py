"""The CUDA sources compile (no GPU needed), so a syntax or template error cannot land; GPU
correctness runs in tests/test_kernels.py when a GPU is present."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch
from torch.utils import cpp_extension

from lightning_lowmem.kernels import build

pytestmark = pytest.mark.slow


def nvcc() -> str:
    home = cpp_extension.CUDA_HOME
    found = shutil.which("nvcc") or (home and shutil.which("nvcc", path=f"{home}/bin"))
    if not found or torch.version.cuda is None:
        pytest.skip("needs nvcc and a CUDA build of torch")
    return found


def cuda_include_paths() -> list[str]:
    try:
        return cpp_extension.include_paths(device_type="cuda")
    except TypeError:  # torch < 2.6 spells it cuda=True
        return cpp_extension.include_paths(cuda=True)


TARGETS = (80, 90)  # the Triton kernels' first two targets (lightning_lowmem.kernels.triton_aot)


def test_cuda_sources_compile_for_every_target_without_spills(tmp_path):
    """Compile-only for sm_80 and sm_90 with the flags torch's extension builder uses; ``-Xptxas -v`` reports each
    kernel's registers and spills: none may spill."""
    command = [
        nvcc(), "-c", str(build.CSRC / "lowmem_cuda.cu"), "-o", str(tmp_path / "lowmem_cuda.o"),
        "-std=c++20", "-O3", "-Xcompiler", "-fPIC", "-Xptxas", "-v",
        *(f"-gencode=arch=compute_{t},code=sm_{t}" for t in TARGETS),
        "-DTORCH_EXTENSION_NAME=lightning_lowmem_cuda", "-DTORCH_API_INCLUDE_EXTENSION_H",
        *cpp_extension.COMMON_NVCC_FLAGS, f"-I{build.CSRC}",
        *(f"-I{path}" for path in cuda_include_paths()),
    ]  # fmt: skip
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"nvcc failed:\n{result.stderr[-4000:]}"
    kernels = ptxas_report(result.stderr)
    assert {target for _, target in kernels} == {f"sm_{t}" for t in TARGETS}
    assert {key: spills for key, (_, spills) in kernels.items() if spills} == {}


def ptxas_report(log: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(kernel, target) -> (registers, spill bytes) from ``ptxas -v``'s log."""
    report, current = {}, None
    for line in log.splitlines():
        if entry := re.search(r"Compiling entry function '(\S+)' for '(sm_\d+)'", line):
            current = entry.groups()
            report[current] = (0, 0)
        elif current and (spill := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            report[current] = (report[current][0], int(spill[1]) + int(spill[2]))
        elif current and (used := re.search(r"Used (\d+) registers", line)):
            report[current] = (int(used[1]), report[current][1])
    return report
