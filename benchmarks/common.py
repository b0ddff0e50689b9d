"""Shared benchmark plumbing: interleaved timing, machine description, RESULTS.md sections.

Each benchmark owns one section of ``benchmarks/RESULTS.md`` (between HTML comment
markers) and rewrites only that section, so benchmarks can run in any order.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


def interleaved_median(fns: dict[str, Callable[[], object]], repeats: int = 20, warmup: int = 3) -> dict[str, float]:
    """Median wall time (seconds) of each function, run round-robin so drift hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def machine() -> str:
    """One line naming the machine and the versions the numbers were taken with."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    return (
        f"{device}, {platform.processor() or platform.machine()}, Python {sys.version.split()[0]}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    )


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(key: str, body: str, command: str, path: Path = RESULTS) -> None:
    """Replace (or append) the section ``key`` of ``path`` (RESULTS.md), stamped with machine and command."""
    stamped = (
        f"<!-- {key}:begin -->\n{body.strip()}\n\n"
        f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}. Command: `{command}`\n<!-- {key}:end -->"
    )
    text = path.read_text() if path.exists() else "# Benchmark results\n\nWritten by the scripts in `benchmarks/`.\n"
    pattern = re.compile(rf"<!-- {re.escape(key)}:begin -->.*?<!-- {re.escape(key)}:end -->", re.DOTALL)
    text = pattern.sub(lambda _: stamped, text) if pattern.search(text) else text.rstrip() + "\n\n" + stamped + "\n"
    path.write_text(text)
