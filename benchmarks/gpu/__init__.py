"""One command for the day a GPU is lent: everything on the GPU, each result written the moment it exists.

    pip install --no-deps -e . && python -m benchmarks.gpu --short --out "$OUT"   # the 8-minute run
    python -m benchmarks.gpu --out DIR                                             # every stage, full sizes
    python -m benchmarks.gpu --publish DIR     # the folder's results -> benchmarks/RESULTS.md "gpu"
    python -m benchmarks.gpu --smoke --out DIR # tiny shapes on the CPU (Triton interpreted): rehearses the script

Stages, in order (``--stages`` picks some; each runs whatever the one before did, a failure is written and the run
goes on): ``environment`` (device, driver, torch, Triton, CUDA), ``tests`` (``pytest -m gpu``: both backends),
``kernels`` (every ahead-of-time Triton configuration and the CUDA C++ extension against the reference,
:mod:`.kernel_check`), ``overhead`` (host microseconds per op call, ours against ATen's, on both backends,
:mod:`.overhead`), ``models`` (eager and ``torch.compile``, :mod:`.models`), ``long_context``
(:mod:`.long_context`: a 24 GiB budget, 75 s of search in ``--short``), ``graphs`` (the models' steps captured as
CUDA graphs: last, since a failed capture leaves the process's generator unusable), ``ops`` (op timings against
Liger Kernel, :mod:`.ops`; not in ``--short``). Each stage writes ``NN-<stage>.md`` into the output folder as it
goes (a killed run keeps what it had) and ``progress.log`` says where it is: no other file, since the device returns
at most ``FILES_RETURNED`` files from its output folder (a run of more stages than leave room for ``progress.log`` is
refused: ``--stages`` picks). The C++ and CUDA extensions build in the background from the
start (nvcc takes about a minute), while the first stages use the GPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import cpu_model, write_section
from benchmarks.gpu.ops import forced_backend, usable_backends

__all__ = ["forced_backend", "main", "usable_backends"]

PACKAGES = ("lightning", "transformers", "peft", "timm", "bitsandbytes", "liger-kernel", "ninja")  # what stages need
STAGES = ("environment", "tests", "kernels", "overhead", "models", "long_context", "graphs", "ops")
SHORT = STAGES[:-1]
FIRST_TESTS = "tests/test_gpu_generator_and_devices.py"  # what only a GPU settles: the generator, graphs, devices
FILES_RETURNED = 8  # the most files the device returns from $OUT: one per stage and progress.log
LONG_CONTEXT_SECONDS = 75  # the --short search's share of the 8 minutes: the interval found by then


@dataclass
class Run:
    """Where results go, and the run's sizes."""

    out: Path
    device: torch.device
    smoke: bool
    short: bool
    rounds: int
    test_seconds: int
    budget_gib: float
    prebuild: tuple[subprocess.Popen, IO[bytes]] | None = None  # the extensions' background build, its output

    def log(self, line: str) -> None:
        stamped = f"{time.strftime('%H:%M:%S')} {line}"
        print(stamped, flush=True)
        with (self.out / "progress.log").open("a") as file:
            file.write(stamped + "\n")

    def emitter(self, index: int, stage: str) -> Callable[[str], None]:
        path = self.out / f"{index:02d}-{stage}.md"
        return lambda text: path.write_text(text + "\n")


def environment(run: Run, emit: Callable[[str], None]) -> str:
    """Device, driver and versions."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError as err:
        triton_version = f"not importable: {err}"
    info = {
        "device": torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else cpu_model(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(run.device)))
        if run.device.type == "cuda" else None,
        "driver": _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
        "python": platform.python_version(), "lightning_lowmem": str(ROOT),
        "nvcc": (_command(["nvcc", "--version"]).splitlines() or [""])[-1],
        **{name: _version(name) for name in PACKAGES},
    }  # fmt: skip
    return "\n".join(f"- {key}: {value}" for key, value in info.items())


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _command(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def tests(run: Run, emit: Callable[[str], None]) -> str:
    """``pytest -m gpu``, :data:`FIRST_TESTS` first, its output in the stage's file as it comes, a test's name
    before it runs (a test that kills the process is named); at most ``run.test_seconds``."""
    files = [FIRST_TESTS, *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))]
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "--tb=short",
        "-rfE",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        *dict.fromkeys(files),
    ]  # fmt: skip (pytest keeps the order of files named, not of a folder's)
    if run.smoke:  # which tests would run, without running them
        command.append("--collect-only")
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    limit = threading.Timer(run.test_seconds, process.kill)  # also when a hung test prints nothing
    limit.start()
    lines: list[str] = []

    def fenced() -> str:
        passed = sum(line.rstrip().endswith(("PASSED", "SKIPPED")) or " PASSED " in line for line in lines)
        shown = [line for line in lines if " PASSED" not in line]  # failures, skips, errors and the summary
        return f"{passed} passed or skipped (not listed)\n\n```\n" + "\n".join(shown[-300:]) + "\n```"

    for line in process.stdout:
        lines.append(line.rstrip())
        emit(fenced())
    limit.cancel()
    code = process.wait()
    lines.append(f"(stopped after {run.test_seconds} s)" if code == -signal.SIGKILL else f"pytest's exit code: {code}")
    return fenced()


def kernels(run: Run, emit: Callable[[str], None]) -> str:
    from benchmarks.gpu.kernel_check import check_kernels

    built = ""
    if run.prebuild is not None:  # its build is the one the check loads: wait for it, and say what it said
        process, log = run.prebuild
        process.wait()
        log.seek(0)
        output = log.read().decode(errors="replace").strip()
        built = f"`python -m lightning_lowmem.kernels build` (in the background):\n```\n{output}\n```\n\n"
    return built + check_kernels(run.device)


def prebuild(run: Run) -> tuple[subprocess.Popen, IO[bytes]]:
    """The C++ (and, on a GPU, CUDA) extensions built in a process of their own while the first stages run; a test
    or stage that needs one meanwhile waits on the build's file lock."""
    run.log("extensions: building in the background")
    command = [sys.executable, "-m", "lightning_lowmem.kernels", "build"]
    log = tempfile.TemporaryFile()  # noqa: SIM115 - the kernels stage reads it
    return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log


def overhead(run: Run, emit: Callable[[str], None]) -> str:
    from benchmarks.gpu.overhead import measure_overhead

    return measure_overhead(run.device)


def models(run: Run, emit: Callable[[str], None]) -> str:
    """The models eager, then ``torch.compile`` (one file: the device returns at most 8)."""
    from benchmarks.gpu.models import SETTINGS, measure_compile, measure_models
    from benchmarks.gpu.models import SHORT as SHORT_SETTINGS

    text = measure_models(run.device, SHORT_SETTINGS if run.short else SETTINGS, run.rounds, run.smoke)
    emit(text)
    try:
        compiled = measure_compile(run.device, run.rounds, run.smoke)
    except Exception:  # noqa: BLE001 - written down: the models' table stands
        compiled = "FAILED\n\n```\n" + traceback.format_exc() + "```"
    return f"{text}\n\n### `torch.compile` on the GPU\n\n{compiled}"


def long_context(run: Run, emit: Callable[[str], None]) -> str:
    from benchmarks.gpu.long_context import search

    return search(run.device, run.budget_gib, run.smoke, emit, seconds=LONG_CONTEXT_SECONDS if run.short else 600)


def graphs(run: Run, emit: Callable[[str], None]) -> str:
    from benchmarks.gpu.models import SETTINGS, measure_graphs
    from benchmarks.gpu.models import SHORT as SHORT_SETTINGS

    if run.smoke:
        return "not on a CPU"
    return measure_graphs(run.device, SHORT_SETTINGS if run.short else SETTINGS, run.rounds)


def ops(run: Run, emit: Callable[[str], None]) -> str:
    from benchmarks.gpu.ops import time_ops

    return time_ops(run.device, shrink=64 if run.smoke else 1, repeats=2 * run.rounds)


RUNNERS = {
    "environment": environment, "tests": tests, "kernels": kernels, "overhead": overhead, "models": models,
    "long_context": long_context, "graphs": graphs, "ops": ops,
}  # fmt: skip
TITLES = {
    "environment": "Environment", "tests": "GPU-marked tests", "kernels": "Kernels against the reference",
    "overhead": "Host time per op call, stock vs ours",
    "models": "Training steps at real dims, stock vs converted (eager, compiled)",
    "long_context": "The longest sequence, predicted and found",
    "graphs": "Training steps captured as CUDA graphs, stock vs converted", "ops": "Ops, forward + backward",
}  # fmt: skip


def run_stages(run: Run, stages: list[str]) -> None:
    for stage in stages:
        index = STAGES.index(stage)
        emit = run.emitter(index, stage)
        run.log(f"{stage}: started")
        started = time.perf_counter()
        try:
            text = RUNNERS[stage](run, emit)
            status = "done"
        except Exception:  # noqa: BLE001 - written down: the next stage still runs
            text = "```\n" + traceback.format_exc() + "```"
            status = "FAILED"
        seconds = time.perf_counter() - started
        emit(f"## {TITLES[stage]}\n\n{status} in {seconds:.0f} s\n\n{text}")
        run.log(f"{stage}: {status} in {seconds:.0f} s")


def publish(folder: Path) -> str:
    """The folder's stage files as RESULTS.md's "gpu" section (returned too)."""
    parts = [path.read_text().replace("\n## ", "\n### ").replace("## ", "### ", 1)
             for path in sorted(folder.glob("[0-9][0-9]-*.md"))]  # fmt: skip
    body = "## GPU: everything on the device\n\n" + "\n".join(parts)
    write_section("gpu", body, "python -m benchmarks.gpu --short")
    return body


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks" / "gpu-out")))
    parser.add_argument("--short", action="store_true", help="the 8-minute run: smaller batches, no op timings")
    parser.add_argument("--stages", nargs="+", choices=STAGES, help="these stages only, in the usual order")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per comparison")
    parser.add_argument("--test-seconds", type=int, default=150, help="the GPU tests' time limit")
    parser.add_argument(
        "--budget-gib",
        type=float,
        default=None,
        help="long_context's budget in GiB (default 24, a consumer GPU's; --short searches it for 75 s)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: rehearses the script")
    parser.add_argument("--publish", type=Path, help="write this output folder's results to RESULTS.md, then exit")
    args = parser.parse_args(argv)
    if args.publish:
        print(publish(args.publish))
        return
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke)")
    args.out.mkdir(parents=True, exist_ok=True)
    budget = args.budget_gib or (0.003 if args.smoke else 24.0)
    run = Run(
        args.out, torch.device("cpu" if args.smoke else "cuda"), args.smoke, args.short or args.smoke,
        2 if args.smoke else args.rounds, args.test_seconds, budget,
    )  # fmt: skip
    chosen = [s for s in (SHORT if run.short else STAGES) if not args.stages or s in args.stages]
    if len(chosen) + 1 > FILES_RETURNED:
        parser.error(f"{len(chosen)} stages and progress.log are more files than the device returns "
                     f"({FILES_RETURNED}): name at most {FILES_RETURNED - 1} with --stages")  # fmt: skip
    if "kernels" in chosen:
        run.prebuild = prebuild(run)
    run_stages(run, chosen)
