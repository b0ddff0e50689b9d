"""Low-memory ops against the stock ops they replace: forward, backward, forward+backward.

Ratios are low-memory time / stock time (below 1 is faster; "eval fwd" is a forward under
``torch.no_grad``, as validation runs it): rounds of all of a row's functions interleaved after warm-up,
in several fresh processes one after another, each round's ratio paired within its process, the median
over all rounds. The norms are affine-free, except in the
rows with a frozen affine (a weight and bias that need no gradient, as under LoRA): the affine is
fused in the low-memory norm's kernel, stock LayerNorm applies it in its own; the low-memory norm
saves its output, and z at the 0.25% of columns where it cannot be rebuilt from it. "bw" is the
bandwidth a compiled kernel reaches (bytes it must read and write / its time) as a fraction of
what ``torch.add`` reaches on tensors of the same shape and dtype. Writes the "kernels" section of ``benchmarks/RESULTS.md``.

    python -m benchmarks.op_speed [--repeats N] [--processes P] [--quick] [--ops TEXT]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import (
    interleaved_times,
    markdown_table,
    paired_ratio,
    record_worker_run,
    reference_spread,
    steady_heap,
    warn_if_busy,
    write_section,
)
from lightning_lowmem import functional, kernels
from lightning_lowmem.registry.activations import ACTIVATIONS

SHAPES = ((8, 197, 3072), (8, 197, 768), (2, 2048, 11008), (2, 2048, 4096))
DTYPES = (torch.float32, torch.bfloat16)
DROPOUT = 0.1


@functools.cache
def frozen_affine(dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A norm's weight and bias that need no gradient (LoRA leaves the norms frozen), made once per shape: as
    pretrained ones, ``|bias| < |weight|`` but in a few columns (MiniLM: 0.3%; here 0.25%, a zero weight)."""
    generator = torch.Generator().manual_seed(0)
    weight = 1 + torch.randn(dim, generator=generator) / 4
    weight[::400] = 0.0
    return weight.to(dtype), (torch.randn(dim, generator=generator) / 10).to(dtype)


def ms_layer_norm_frozen_affine(x: torch.Tensor) -> torch.Tensor:
    weight, bias = frozen_affine(x.shape[-1], x.dtype)
    return functional.ms_layer_norm(x, x.shape[-1:], weight=weight, bias=bias)


STEP_ROWS = {  # name -> (activation, bits): the step-derivative activations, at the paper's 2 bits and at 1 and 4
    "ReGELU2 / gelu": ("gelu", 2),
    "GELU 1-bit / gelu": ("gelu", 1),
    "GELU 4-bit / gelu": ("gelu", 4),
    "ReSiLU2 / silu": ("silu", 2),
    "SiLU 1-bit / silu": ("silu", 1),
    "SiLU 4-bit / silu": ("silu", 4),
}

OPS: dict[str, tuple[Callable, Callable]] = {  # name -> (low-memory op, stock op)
    **{
        name: (
            functools.partial(functional.step_activation, activation=activation, bits=bits),
            ACTIVATIONS[activation].stock,
        )
        for name, (activation, bits) in STEP_ROWS.items()
    },
    "MS-LN / layer_norm": (
        lambda x: functional.ms_layer_norm(x, x.shape[-1:]),
        lambda x: F.layer_norm(x, x.shape[-1:]),
    ),
    "MS-LN / layer_norm, frozen affine": (
        ms_layer_norm_frozen_affine,
        lambda x: F.layer_norm(x, x.shape[-1:], *frozen_affine(x.shape[-1], x.dtype)),
    ),
    "MS-RMSNorm / rms_norm": (
        lambda x: functional.ms_rms_norm(x, x.shape[-1:]),
        lambda x: F.rms_norm(x, x.shape[-1:], eps=1e-6),
    ),
    "seeded dropout / dropout, p=0.1": (
        lambda x: functional.seeded_dropout(x, DROPOUT),
        lambda x: F.dropout(x, DROPOUT),
    ),
}


def phases(op: Callable, x: torch.Tensor, g: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Forward (recording the graph), backward alone (on a retained graph), both, and the eval forward
    (``torch.no_grad``: what validation runs). The retained graph is built on a copy of ``x`` that nothing
    else reads: what each op saved is then as cold in the backward alone as in training. On ``x`` itself,
    which every timed function reads, stock's saved input stayed in cache and the low-memory op's saved
    output did not (the frozen MS-LN "bwd" read 1.47-1.53x at 8x197x768 with a fwd+bwd of 1.14-1.20)."""
    x_saved = x.detach().clone().requires_grad_(x.requires_grad)
    y = op(x_saved)
    return {
        "fwd": lambda: op(x),
        "bwd": lambda: torch.autograd.grad(y, x_saved, g, retain_graph=True),
        "fwd+bwd": lambda: torch.autograd.grad(op(x), x, g),
        "eval fwd": torch.no_grad()(lambda: op(x)),
    }


def kernel_calls(name: str, x: torch.Tensor, g: torch.Tensor) -> dict[str, tuple[Callable[[], object], int]]:
    """The compiled forward and backward kernel of an op, with the bytes each must move."""
    impl = kernels.implementation(x.device)
    n, size, dim = x.numel(), x.element_size(), x.shape[-1]
    rows = n // dim
    if name in STEP_ROWS:
        activation, bits = STEP_ROWS[name]
        step = ACTIVATIONS[activation].step_derivative(bits)
        packed = impl.act_codes(x, step.thresholds)
        packed_bytes = packed.numel()
        return {
            "fwd": (lambda: impl.act_codes(x, step.thresholds), n * size + packed_bytes),
            "bwd": (lambda: impl.act_backward(g, packed, step.levels), 2 * n * size + packed_bytes),
        }
    if name.startswith("seeded dropout"):  # the mask drawn from the seed, applied to x, then to the gradient
        seed = torch.tensor([1])
        return {
            "fwd": (lambda: impl.dropout(x, DROPOUT, seed), 2 * n * size),
            "bwd": (lambda: impl.dropout(g, DROPOUT, seed), 2 * n * size),
        }
    center = name.startswith("MS-LN")
    if name.endswith("frozen affine"):  # writes y alone; its backward rebuilds z from y
        scale, shift = (p.float() for p in frozen_affine(dim, x.dtype))
        columns = impl.norm_exact_columns(scale, shift)
        y, rstd, exact = impl.norm_output_forward(x, dim, 1e-5, center, x.dtype, scale, shift, columns)
        return {
            "fwd": (
                lambda: impl.norm_output_forward(x, dim, 1e-5, center, x.dtype, scale, shift, columns),
                2 * n * size + 4 * rows,
            ),
            "bwd": (
                lambda: impl.norm_output_backward(g, y, rstd, scale, shift, columns, exact, dim, center, x.dtype),
                3 * n * size + 4 * rows,
            ),
        }
    z, rstd = impl.norm_forward(x, dim, 1e-5, center, x.dtype)
    return {
        "fwd": (lambda: impl.norm_forward(x, dim, 1e-5, center, x.dtype), 2 * n * size + 4 * rows),
        "bwd": (lambda: impl.norm_backward(g, z, rstd, None, dim, center, x.dtype, False), 3 * n * size + 4 * rows),
    }


def timed_rounds(name: str, shape: tuple[int, ...], dtype: torch.dtype, repeats: int) -> dict[str, dict]:
    """One process's interleaved rounds of a row: the times of each function ("low fwd", "stock fwd", ...,
    "add", "kernel fwd", ...) and the bytes each compiled kernel must move."""
    low, stock = OPS[name]
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    g = torch.randn(shape, dtype=dtype)
    fns = {}
    for phase, fn in phases(low, x, g).items():
        fns[f"low {phase}"] = fn
    for phase, fn in phases(stock, x, g).items():
        fns[f"stock {phase}"] = fn
    detached = x.detach()
    fns["add"] = lambda: torch.add(detached, g)  # allocates its output, like the kernels
    calls = kernel_calls(name, detached, g)
    for phase, (fn, _) in calls.items():
        fns[f"kernel {phase}"] = fn
    return {"times": interleaved_times(fns, repeats=repeats), "bytes": {p: n for p, (_, n) in calls.items()}}


def table_row(name: str, shape: tuple[int, ...], dtype: torch.dtype, runs: list[dict[str, dict]]) -> list[object]:
    """The row from the rounds of one or more processes: ratios over all their rounds, each paired within its
    process, and the range of the processes' own fwd+bwd ratios (on this VM a process's memory placement
    moves a small op's ratio by up to 30%, more than the rounds within one process do)."""
    times = {key: [t for run in runs for t in run["times"][key]] for key in runs[0]["times"]}
    t = {key: statistics.median(values) for key, values in times.items()}
    add_bandwidth = 3 * math.prod(shape) * dtype.itemsize / t["add"]
    ratio = {
        phase: paired_ratio(times[f"low {phase}"], times[f"stock {phase}"])
        for phase in ("fwd", "bwd", "fwd+bwd", "eval fwd")
    }
    per_process = [paired_ratio(run["times"]["low fwd+bwd"], run["times"]["stock fwd+bwd"])[0] for run in runs]
    bandwidth = {phase: n / t[f"kernel {phase}"] / add_bandwidth for phase, n in runs[0]["bytes"].items()}
    return [
        name,
        "x".join(map(str, shape)),
        str(dtype).removeprefix("torch."),
        f"{ratio['fwd'][0]:.2f}",
        f"{ratio['bwd'][0]:.2f}",
        "**{:.2f}** ({:.2f}-{:.2f})".format(*ratio["fwd+bwd"]),
        f"{min(per_process):.2f}-{max(per_process):.2f}",
        f"{ratio['eval fwd'][0]:.2f}",
        f"{t['stock fwd+bwd'] * 1e3:.1f}",
        f"{t['low fwd+bwd'] * 1e3:.1f}",
        f"{bandwidth['fwd']:.2f}",
        f"{bandwidth['bwd']:.2f}",
    ]


def rows(quick: bool, ops: str = "") -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The table's rows: every op (or those whose name contains ``ops``) at every shape (the first two: ``quick``)
    and dtype."""
    shapes = SHAPES[:2] if quick else SHAPES
    return [(name, shape, dtype) for name in OPS if ops in name for shape in shapes for dtype in DTYPES]


def measure_all(quick: bool, repeats: int, ops: str = "") -> dict[str, object]:
    """This process's rounds of every row (the first row timed once before, thrown away: the first timing in
    a process is slow for low-mem and stock alike, and unevenly: the thread pool starting, malloc growing
    its heap), with the reference spread after them and whether glibc kept its heap."""
    timed_rounds(*rows(quick, ops)[0], repeats)
    runs = [timed_rounds(*row, repeats) for row in rows(quick, ops)]
    return {"runs": runs, "spread": reference_spread(), "steady_heap": bool(steady_heap())}


HEADER = [
    "op (low-mem / stock)",
    "shape",
    "dtype",
    "fwd",
    "bwd",
    "fwd+bwd (95% interval)",
    "per process",
    "eval fwd",
    "stock fwd+bwd ms",
    "low-mem fwd+bwd ms",
    "fwd kernel bw",
    "bwd kernel bw",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds in each process")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes taking the rounds, one after another")
    parser.add_argument("--quick", action="store_true", help="first two shapes only, in this process, no RESULTS.md")
    parser.add_argument("--ops", default="", help="only the ops whose name contains this text, no RESULTS.md")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # prints its rounds as JSON
    args = parser.parse_args()
    if not rows(args.quick, args.ops):
        parser.error(f"no op's name contains {args.ops!r}; the ops: {', '.join(OPS)}")
    if args.worker:
        print(json.dumps(measure_all(args.quick, args.repeats, args.ops)))
        return
    warn_if_busy()
    active = kernels.backend("cpu")
    print(f"backend: {active}, threads: {torch.get_num_threads()}, processes: {1 if args.quick else args.processes}")
    if args.quick:
        measured = [measure_all(True, args.repeats, args.ops)]
    else:
        worker = [sys.executable, "-m", "benchmarks.op_speed", "--worker", "--repeats", str(args.repeats)]
        worker += ["--ops", args.ops]
        measured = []
        for process in range(args.processes):
            print(f"process {process + 1} of {args.processes} ...", flush=True)
            done = subprocess.run(worker, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
            measured.append(json.loads(done.stdout.splitlines()[-1]))
            record_worker_run(measured[-1]["spread"], measured[-1]["steady_heap"])
    table_rows = []
    for index, row in enumerate(rows(args.quick, args.ops)):
        table_rows.append(table_row(*row, [run["runs"][index] for run in measured]))
        print(" | ".join(table_rows[-1]), flush=True)
    table = markdown_table(HEADER, table_rows)
    print(table)
    if args.quick or args.ops:  # a part of the table
        return
    body = (
        f"### Compiled kernels (backend `{active}`)\n\n"
        "Time ratios low-memory / stock (below 1 = faster; targets: fwd+bwd <= 1.0): the median of the "
        f"per-round ratios of {args.repeats} interleaved rounds in each of {args.processes} fresh processes, fwd+bwd "
        "with its 95% bootstrap interval and the range of the processes' own medians (how far "
        'this machine\'s noise lets the ratio be read); times in ms are medians. "bw": bytes the compiled kernel must move / its time, as a fraction of the bandwidth '
        "`torch.add` reaches on the same shape and dtype (the forward activation kernel computes the "
        "codes only; the op adds the stock activation). The norms are affine-free except in the rows with a "
        "frozen affine (weight and bias needing no gradient, as under LoRA; `|bias| < |weight|` but in 0.25% "
        "of the columns, as in pretrained norms): there the low-memory norm saves its output, which its readers "
        "save too, and `z` exactly at those columns; its backward rebuilds `z` from the output. Dropout: "
        f"p = {DROPOUT}; stock `F.dropout` draws and keeps a mask, the seeded one draws it from its seed in "
        "forward and again in backward.\n\n" + table
    )
    write_section(
        "kernels", body, f"python -m benchmarks.op_speed --repeats {args.repeats} --processes {args.processes}"
    )


if __name__ == "__main__":
    main()
