"""Every Triton kernel configuration the launchers can choose, compiled ahead of time for GPU targets: no GPU needed.

    python -m lightning_lowmem.kernels.triton_aot [--targets 80 90 100 120] [--json PATH]

The configurations come from the launchers of :mod:`~lightning_lowmem.kernels.triton_ops` themselves: each is
called with inputs spanning every choice it makes (each dtype it accepts, bits, kinds, flags, every row block and
warp count :func:`~lightning_lowmem.kernels.triton_ops.norm_settings` and
:func:`~lightning_lowmem.kernels.triton_ops.cross_entropy_settings` can return), with its kernels replaced by
recorders. Each configuration is compiled for each target in worker processes that report case by case, so that a
compiler crash (a segfault) fails that configuration and the run goes on; the ``ptxas -v`` that Triton ships
reports registers and spill bytes. Run without ``TRITON_INTERPRET`` (the kernels must be Triton's own).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

TARGETS = (80, 90, 100, 120)  # A100; H100/H200; B200; RTX 50xx
WORKERS = 2


def _recorded_launches() -> list[tuple[Any, tuple, dict]]:
    """(kernel, args, kwargs) of every launch the launchers make for inputs spanning their choices."""
    from lightning_lowmem.kernels import triton_ops

    records: list[tuple[Any, tuple, dict]] = []

    class Recorder:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: records.append((self.kernel, args, kwargs))

    kernels = {n: getattr(triton_ops, n) for n in dir(triton_ops) if n.endswith("_kernel")}
    interpreted = triton_ops.INTERPRETED
    for name, kernel in kernels.items():
        setattr(triton_ops, name, Recorder(kernel))
    triton_ops.INTERPRETED = True  # the wrappers take CPU tensors: the recorders run nothing
    try:
        launch_every_choice(triton_ops)
    finally:
        for name, kernel in kernels.items():
            setattr(triton_ops, name, kernel)
        triton_ops.INTERPRETED = interpreted
    return records


def launch_every_choice(ops: Any, device: torch.device | str = "cpu") -> None:
    """Call every launcher of the declared ops on ``ops`` (:mod:`.triton_ops`, or any backend's functions) with inputs
    on ``device`` spanning each choice the Triton launchers make: every dtype, bits, kind and flag, every row block
    and warp count of :func:`~.triton_ops.norm_settings` and :func:`~.triton_ops.cross_entropy_settings`."""
    from lightning_lowmem.kernels import torch_ops, triton_ops

    def tensor(*shape: int, dtype: torch.dtype = torch.float32, like: float | None = None) -> torch.Tensor:
        made = torch.randn(shape) if like is None else torch.full(shape, like)
        return made.to(device=device, dtype=dtype)

    largest = max(triton_ops.MAX_NORM_BLOCK, triton_ops.MAX_CE_BLOCK)
    lengths = [1 << k for k in range(largest.bit_length())]  # row lengths reaching every block choice
    seed = torch.tensor([1], device=device)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = tensor(2, 64, dtype=dtype)
        for bits in (1, 2, 4):
            thresholds = tuple(range((1 << bits) - 1))
            ops.act_codes(x, thresholds)
            ops.act_backward(x, torch_ops.act_codes(x, thresholds), (0.0,) * (len(thresholds) + 1))
        exceptions = torch_ops.gated_exceptions(x, x, 2)
        for kind in torch_ops.KINDS:
            for act in (None, x):
                ops.gated_backward(x, x, x, kind, act)
            ops.gated_backward(x, x, x, kind, x, *exceptions)
        for cols in sorted({min(triton_ops.MAX_NORM_BLOCK, max(triton_ops.MIN_ROW_BLOCK, n)) for n in lengths}):
            ops.gated_exceptions(tensor(2, cols, dtype=dtype), tensor(2, cols, dtype=dtype), 2)
        for p in (0.1, 0.5):  # the threshold an int32, then an int64
            ops.dropout(x, p, seed)
        ops.dropout(x, 0.1, torch.tensor([1, 2**40], device=device))  # a key and a first counter
        columns = tensor(64, like=1.0)
        for scale, shift in ((None, None), (columns, None), (columns, columns)):  # LoRA's input: as it is, RMS, LN
            for first in (seed, torch.tensor([1, 2**40], device=device)):
                ops.dropout_input_and_grad(x, scale, shift, dtype, x, 0.1, first)
        for weights in {dtype, torch.float32}:  # bf16-true, or fp32 weights under autocast
            for scale, shift in ((columns, None), (columns, columns), (None, columns)):  # RMS, LN, a shift alone
                ops.affine_weight_grad(x, None if shift is None else x[:, 0], scale, shift, weights)
        for dim in sorted({triton_ops.norm_settings(n)[0] for n in lengths}):
            rows, rstd = tensor(2, dim, dtype=dtype), tensor(2, like=1.0)
            for center in (True, False):
                for out in {dtype, torch.bfloat16} if dtype == torch.float32 else {dtype}:
                    ops.norm_forward(rows, dim, 1e-5, center, out)
                affine = tensor(dim, like=1.0)  # LayerNorm's scale and shift, RMSNorm's scale
                ops.norm_affine_forward(rows, dim, 1e-5, center, dtype, affine, affine if center else None)
                for scale in (None, tensor(dim, like=1.0)):
                    ops.norm_backward(rows, rows, rstd, scale, dim, center, torch.float32, False)
        ops.norm_backward(x, x, tensor(2, like=1.0), None, 64, True, torch.float32, True)  # and the column sums
    for dtype in torch_ops.CROSS_ENTROPY_DTYPES:
        for vocab in sorted({triton_ops.cross_entropy_settings(n, dtype)[0] for n in lengths}):
            for cap in (0.0, 30.0):
                for scale in (None, tensor(2, like=1.0)):
                    labels = torch.tensor([1, -100], device=device)
                    ops.cross_entropy_grad_(tensor(2, vocab, dtype=dtype), labels, -100, 0.1, cap, scale)
            labels, rows = torch.tensor([1, -100], device=device), tensor(2, like=1.0)
            ops.token_log_probs(tensor(2, vocab, dtype=dtype), labels, -100, 0.7)
            for entropy in (None, rows):
                ops.token_log_probs_grad_(tensor(2, vocab, dtype=dtype), labels, rows, rows, rows, entropy, -100, 0.7)


def configurations() -> list[dict[str, Any]]:
    """Every distinct configuration: kernel, argument types, constexprs, warps (JSON-able)."""
    from triton.runtime.jit import mangle_type

    found: dict[str, dict[str, Any]] = {}
    for kernel, args, kwargs in _recorded_launches():
        warps = kwargs.pop("num_warps", 4)
        constexprs = {**{n: a for n, a in zip(kernel.arg_names, args) if a is None}, **kwargs}
        signature = {n: mangle_type(a) for n, a in zip(kernel.arg_names, args)} | dict.fromkeys(kwargs, "constexpr")
        config = {"kernel": kernel.__name__, "signature": signature, "constexprs": constexprs, "num_warps": warps}
        found.setdefault(json.dumps(config, sort_keys=True), config)
    return list(found.values())


def compile_one(config: dict[str, Any], target: int) -> dict[str, Any]:
    """Compile ``config`` (its ``kernel`` in its ``module``, :mod:`.triton_ops` by default) for ``sm_<target>``:
    registers and spill bytes from ``ptxas -v``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    kernel = getattr(
        importlib.import_module(config.get("module", "lightning_lowmem.kernels.triton_ops")), config["kernel"]
    )
    source = ASTSource(kernel, config["signature"], config["constexprs"])
    binary = triton.compile(source, target=GPUTarget("cuda", target, 32), options={"num_warps": config["num_warps"]})
    ptx = binary.asm["ptx"]
    arch = re.search(r"^\.target (\S+)", ptx, re.MULTILINE).group(1)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as file:
        file.write(ptx)
        file.flush()
        log = subprocess.run(
            [get_ptxas(target).path, "-v", f"--gpu-name={arch}", file.name, "-o", os.devnull],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    used = re.search(r"Used (\d+) registers", log)
    if used is None:
        raise RuntimeError(f"ptxas -v reported no register count:\n{log}")
    registers = int(used.group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return {"registers": registers, "spill_bytes": spills}


def _worker(configs_file: str, items: list[tuple[int, int]]) -> None:
    """Compile the (configuration index, target) ``items`` of the configurations in ``configs_file``, a line before
    and after each (the parent knows which one a crash killed)."""
    from triton.errors import TritonError

    configs = json.loads(Path(configs_file).read_text())
    for index, target in items:
        print(json.dumps({"start": [index, target]}), flush=True)
        try:
            result = {"ok": True, **compile_one(configs[index], target)}
        except (TritonError, RuntimeError, subprocess.CalledProcessError) as err:  # the run lists every failure
            result = {"ok": False, "error": f"{type(err).__name__}: {str(err).strip().splitlines()[-1]}"}
        print(json.dumps({"index": index, "target": target, **result}), flush=True)


def compile_configs(configs: list[dict[str, Any]], targets: list[int]) -> list[dict[str, Any]]:
    """One result per (configuration, target), compiled by :data:`WORKERS` processes; a configuration that crashes
    the compiler is reported as failed and a new worker goes on from the next."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    items = [(index, target) for index in range(len(configs)) for target in targets]
    results = []
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(configs, file)
        file.flush()
        running = [(queue, _spawn(file.name, queue, env)) for k in range(WORKERS) if (queue := items[k::WORKERS])]
        while running:
            queue, process = running.pop(0)
            finished, inflight = 0, None
            for line in process.stdout:
                record = json.loads(line)
                if "start" in record:
                    inflight = tuple(record["start"])
                else:
                    results.append(record)
                    finished += 1
                    inflight = None
            process.wait()
            if inflight is not None:  # the worker died inside this compile
                index, target = inflight
                results.append({"index": index, "target": target, "ok": False,
                                "error": f"compiler crashed (exit {process.returncode})"})  # fmt: skip
                if rest := queue[finished + 1 :]:
                    running.append((rest, _spawn(file.name, rest, env)))
    return sorted(results, key=lambda r: (r["index"], r["target"]))


def _spawn(configs_file: str, items: list[tuple[int, int]], env: dict[str, str]) -> subprocess.Popen:
    work = ",".join(f"{index}:{target}" for index, target in items)
    command = [sys.executable, "-m", "lightning_lowmem.kernels.triton_aot", "--worker", configs_file, work]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)


def compile_all(targets: list[int]) -> dict[str, Any]:
    """Every configuration the launchers can choose, compiled for every target: the configurations and one result
    per (configuration, target)."""
    configs = configurations()
    return {"targets": targets, "configurations": configs, "results": compile_configs(configs, targets)}


def table(report: dict[str, Any]) -> str:
    """Per kernel and target: configurations, the most registers, spill bytes, failures (markdown)."""
    rows = {}
    for result in report["results"]:
        kernel = report["configurations"][result["index"]]["kernel"]
        row = rows.setdefault((kernel, result["target"]), {"n": 0, "registers": 0, "spills": 0, "failed": 0})
        row["n"] += 1
        row["registers"] = max(row["registers"], result.get("registers", 0))
        row["spills"] += result.get("spill_bytes", 0)
        row["failed"] += not result["ok"]
    lines = [
        "| kernel | target | configurations | most registers | spill bytes | failed |",
        "|---|---|---|---|---|---|",
    ]
    for (kernel, target), r in sorted(rows.items()):
        lines.append(f"| `{kernel}` | sm_{target} | {r['n']} | {r['registers']} | {r['spills']} | {r['failed']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_lowmem.kernels.triton_aot", description=__doc__)
    parser.add_argument("--targets", nargs="+", type=int, default=list(TARGETS), help="compute capabilities")
    parser.add_argument("--json", type=Path, help="write the configurations and results here")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # configurations file, "index:target,..."
    args = parser.parse_args(argv)
    if args.worker is not None:
        configs_file, work = args.worker
        _worker(configs_file, [tuple(map(int, item.split(":"))) for item in work.split(",")])
        return 0
    report = compile_all(args.targets)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(table(report))
    failures = [r for r in report["results"] if not r["ok"]]
    for failure in failures:
        config = report["configurations"][failure["index"]]
        print(f"FAILED sm_{failure['target']} {config}: {failure['error']}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
