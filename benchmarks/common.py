"""Shared benchmark plumbing: interleaved timing, machine description, RESULTS.md sections.

Each benchmark owns one section of ``benchmarks/RESULTS.md`` (between HTML comment
markers) and rewrites only that section, so benchmarks can run in any order.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.forced_capability import emulate

emulate()  # before torch's first use

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


def _own_share_of_load() -> float:
    """What this process itself has added to the 1-minute load average since it started (importing torch
    takes seconds of a core): its CPU use so far, weighted as the kernel's exponential average weighs it."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime: seconds after boot
        elapsed = float(Path("/proc/uptime").read_text().split()[0]) - started
    except (OSError, ValueError, IndexError):  # not Linux
        return 0.0
    if elapsed <= 0:
        return 0.0
    return min(time.process_time() / elapsed, 1.0) * (1 - math.exp(-elapsed / 60))


# The 1-minute load average of the other processes when this benchmark started (read at import).
LOAD_AT_START = max(os.getloadavg()[0] - _own_share_of_load(), 0.0)
MAX_LOAD = 0.5  # machine-wide: above it, other processes share the cores and the memory bandwidth
# of a reference op's run-to-run times, interquartile range / median: 8-16% on a quiet 2-core VM here
# (its memory bandwidth varies), 100% and more while another process computes
MAX_SPREAD = 0.30
_timed = False  # whether this process took timings (a section of memory numbers needs no quiet machine)


def keep_freed_heap() -> bool:
    """Make glibc keep freed memory in its heap (no trimming) and serve every block from it (no mmap), as PyTorch's
    caching GPU allocator does; False where the C library is not glibc. By default glibc hands freed memory back to
    the kernel whenever the heap's free top grows past a threshold it adjusts as it goes, and the next allocation
    takes a page fault per 4 KiB page: 1,150 (0.3-1 ms) for a 4.7 MB tensor. Which timed function pays depends on
    the order of the allocations before it, not on the function: here the low-memory frozen norm took them in the
    median round in one process and stock LayerNorm in another. An mmap threshold alone (32 MiB, glibc's largest)
    left a block of 32 MiB or more mapped afresh at each call, or served from freed heap, by what earlier rows had
    freed: MS-LN's bfloat16 2x2048x4096 row (32 MiB tensors) read 0.91-1.42 by the process."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    return bool(mallopt(m_trim_threshold, 2**31 - 1)) and bool(mallopt(m_mmap_max, 0))


_steady_heap: bool | None = None  # whether keep_freed_heap took effect, once this process times something


def steady_heap() -> bool | None:
    """Whether the timings of this process ran with glibc's freed heap kept (None: it took none)."""
    return _steady_heap


def record_worker_run(spread: float, steady: bool) -> None:
    """Account for timings a worker process took, in this process's busy check (the worker's reference spread,
    measured after its timings) and machine line (whether its heap was kept)."""
    global _timed, _worst_spread, _steady_heap
    _timed = True
    _worst_spread = max(_worst_spread, spread)
    _steady_heap = steady if _steady_heap is None else _steady_heap and steady


def interleaved_times(
    fns: dict[str, Callable[[], object]], repeats: int = 20, warmup: int = 3, cuda_events: bool = False
) -> dict[str, list[float]]:
    """Wall times (seconds) of each function, one per round, run round-robin with the order reversed every
    other round and rotated by one every two, so that drift hits all alike and each function takes every
    position in turn, after different ones (what ran before leaves the caches and the allocator in its own
    state). Cycling through all permutations did not: past a few functions their first ones never change.
    ``cuda_events``: timed on the current CUDA stream from an idle device (its gaps waiting for the host
    included), for functions whose work is the GPU's."""
    global _timed, _steady_heap
    _timed = True
    if _steady_heap is None:
        _steady_heap = keep_freed_heap()
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeats):
        shift = (round_ // 2) % len(names)
        order = names[shift:] + names[:shift]
        for name in order if round_ % 2 == 0 else order[::-1]:
            samples[name].append(_cuda_event_time(fns[name]) if cuda_events else _wall_time(fns[name]))
    return samples


def _wall_time(fn: Callable[[], object]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _cuda_event_time(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def interleaved_median(fns: dict[str, Callable[[], object]], repeats: int = 20, warmup: int = 3) -> dict[str, float]:
    """Median wall time (seconds) of each function, timed by :func:`interleaved_times`."""
    return {name: statistics.median(times) for name, times in interleaved_times(fns, repeats, warmup).items()}


def paired_ratio(times: list[float], reference: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """The median of the per-round ratios ``times / reference`` (timed in the same rounds) and the bounds of its
    bootstrap ``confidence`` interval: how far this machine's noise lets the ratio be read."""
    ratios = [t / r for t, r in zip(times, reference, strict=True)]
    rng = random.Random(0)  # the same resamples every run: the interval is a property of the samples
    resamples = 2000
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = int(resamples * (1 - confidence) / 2)
    return statistics.median(ratios), medians[tail], medians[-1 - tail]


def reference_spread(repeats: int = 60) -> float:
    """Run-to-run spread of a fixed memory-bound op (an add of two 16 MiB tensors into a third), now; into
    a preallocated output, so that the kernel's page faults on fresh memory do not count."""
    a, b, out = torch.ones(4 << 20), torch.ones(4 << 20), torch.empty(4 << 20)
    times = []
    for i in range(repeats + 10):
        start = time.perf_counter()
        torch.add(a, b, out=out)
        if i >= 10:  # after a warm-up
            times.append(time.perf_counter() - start)
    quartiles = statistics.quantiles(times, n=4)
    return (quartiles[-1] - quartiles[0]) / statistics.median(times)


def busy_reason(spread: float | None) -> str | None:
    """Why CPU timings taken in this process cannot be trusted (``spread``: the reference op's, None before any
    timing), or None (GPU timings are not checked)."""
    if torch.cuda.is_available():
        return None
    if LOAD_AT_START > MAX_LOAD:
        return f"the 1-minute load average was {LOAD_AT_START:.2f} when the benchmark started (quiet: <= {MAX_LOAD})"
    if spread is not None and spread > MAX_SPREAD:
        return f"a reference op's run-to-run spread is {spread:.0%} (quiet: <= {MAX_SPREAD:.0%})"
    return None


def warn_if_busy() -> None:
    """Says before a timing run, rather than after it, that its timings will not be written (a full op benchmark
    runs 25 minutes before it would find out)."""
    reason = busy_reason(None)
    if reason is not None:
        print(f"warning: {reason}: the timings will print, not go into RESULTS.md", file=sys.stderr, flush=True)


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (machines of one kind differ in CPU, and ratios with it), else the architecture."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(spread: float | None = None) -> str:
    """One line naming the machine, the versions the numbers were taken with and, for timings, how quiet it was."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    line = (
        f"{device}, {cpu_model()}, ATen CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, Python {sys.version.split()[0]}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    )
    if spread is not None:
        line += f", load {LOAD_AT_START:.2f} at start, reference spread {spread:.1%}"
        if _steady_heap:
            line += ", glibc heap kept (no trimming, no mmap)"
    return line


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


_worst_spread = 0.0  # the largest reference spread this process has seen: one busy check taints its whole run
_found: dict[tuple[Path, str], str | None] = {}  # each section as this process found it before writing it


def _section(key: str) -> re.Pattern:
    return re.compile(rf"<!-- {re.escape(key)}:begin -->.*?<!-- {re.escape(key)}:end -->", re.DOTALL)


def _replace_section(path: Path, key: str, section: str | None) -> None:
    """Put ``section`` (or nothing, for None) where ``key``'s section is in ``path``, or append it; a file
    that would not change is left alone."""
    before = path.read_text() if path.exists() else None
    text = before if before is not None else "# Benchmark results\n\nWritten by the scripts in `benchmarks/`.\n"
    pattern = _section(key)
    if pattern.search(text):
        text = pattern.sub(lambda _: section or "", text)
    elif section is not None:
        text = text.rstrip() + "\n\n" + section + "\n"
    if text != before and (before is not None or section is not None):
        path.write_text(text)


def write_section(key: str, body: str, command: str, path: Path = RESULTS) -> bool:
    """Replace (or append) the section ``key`` of ``path`` (RESULTS.md), stamped with machine and command.

    A section with timings is refused, with the reason printed, when the machine was busy: numbers
    taken under load do not reproduce. A benchmark that writes its section as it goes (after every
    row) is judged by the worst check of its run: once one check finds the machine busy, the section
    goes back to what the run found and stays so. Under ``ATEN_CPU_CAPABILITY`` the section is
    ``key-<capability>``: the native code's numbers stay. Returns whether the section was written."""
    global _worst_spread
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    if forced:  # ATen told to run other code (AVX2 on an AVX512 machine): a section of its own, beside the native one
        key, command = f"{key}-{forced.lower()}", f"ATEN_CPU_CAPABILITY={forced} {command}"
        heading, _, rest = body.strip().partition("\n")
        body = f"{heading} (ATEN_CPU_CAPABILITY={forced})\n{rest}" if heading.startswith("#") else body
    if (path, key) not in _found:
        found = _section(key).search(path.read_text()) if path.exists() else None
        _found[(path, key)] = found.group(0) if found else None
    spread = None
    if _timed:
        _worst_spread = max(_worst_spread, reference_spread())
        spread = _worst_spread
    reason = busy_reason(spread) if spread is not None else None
    if reason is not None:
        print(f"not writing the {key!r} section of {path.name}: {reason}; rerun on a quiet machine", file=sys.stderr)
        _replace_section(path, key, _found[(path, key)])  # rows this run wrote earlier are no better
        return False
    _replace_section(
        path,
        key,
        f"<!-- {key}:begin -->\n{body.strip()}\n\n"
        f"Machine: {machine(spread)}. Date: {time.strftime('%Y-%m-%d')}. Command: `{command}`\n<!-- {key}:end -->",
    )
    return True
