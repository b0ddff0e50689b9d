"""Every benchmark script runs end to end in its smoke mode and leaves RESULTS.md alone."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SMOKE = {
    "saved_bytes.py": ["--smoke"],
    "kernels.py": ["--quick", "--repeats", "1"],
    "paper_tables.py": ["--smoke"],
    "parity.py": ["--smoke"],
    "gated_mlp.py": ["--smoke"],
    "budget.py": ["--smoke"],
    "qlora.py": ["--smoke"],
}


@pytest.mark.parametrize("script", SMOKE)
def test_benchmark_smoke(script, monkeypatch, capsys):
    results = BENCHMARKS / "RESULTS.md"
    before = results.read_text()
    monkeypatch.setattr(sys, "argv", [script, *SMOKE[script]])
    runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    assert "|---" in capsys.readouterr().out  # printed a table
    assert results.read_text() == before
