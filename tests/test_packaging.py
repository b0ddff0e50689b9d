"""An installed wheel, not the source checkout, can build and run the compiled kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lightning_lowmem.kernels import build

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_an_installed_wheel_builds_and_runs_the_cpp_kernels(tmp_path):
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(tmp_path)], check=True)
    (wheel,) = tmp_path.glob("lightning_lowmem-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    sources = {*build.SOURCES["cpu"], *build.SOURCES["cuda"], *build.HEADERS}
    assert {f"lightning_lowmem/kernels/csrc/{name}" for name in sources} <= shipped

    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    env = os.environ | {"PYTHONPATH": str(site), build.CACHE_ENV: str(tmp_path / "cache")}  # a cache of its own
    script = "import lightning_lowmem; from lightning_lowmem import kernels; print(lightning_lowmem.__file__, kernels.backend())"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, check=True, timeout=600
    )
    assert out.stdout.split() == [str(site / "lightning_lowmem" / "__init__.py"), "cpp"], out.stderr
