"""The CUDA sources compile (no GPU needed), so a syntax or template error cannot land; GPU
correctness runs in tests/test_kernels.py when a GPU is present."""

from __future__ import annotations

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


def test_cuda_sources_compile(tmp_path):
    """Compile-only for one arch (sm_90) with the flags torch's extension builder uses."""
    command = [
        nvcc(), "-c", str(build.CSRC / "lowmem_cuda.cu"), "-o", str(tmp_path / "lowmem_cuda.o"),
        "-std=c++20", "-O3", "-Xcompiler", "-fPIC", "-gencode=arch=compute_90,code=sm_90",
        "-DTORCH_EXTENSION_NAME=lightning_lowmem_cuda", "-DTORCH_API_INCLUDE_EXTENSION_H",
        *cpp_extension.COMMON_NVCC_FLAGS, f"-I{build.CSRC}",
        *(f"-I{path}" for path in cuda_include_paths()),
    ]  # fmt: skip
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"nvcc failed:\n{result.stderr[-4000:]}"
