"""Low-memory ops against the stock ops they replace: forward, backward, forward+backward.

Ratios are low-memory time / stock time (below 1 is faster; "eval fwd" is a forward under
``torch.no_grad``, as validation runs it), measured in one process,
interleaved, median of repeated runs after warm-up. The norms are affine-free, except in the
rows with a frozen affine (a weight and bias that need no gradient, as under LoRA): the affine is
fused in the low-memory norm's kernel, stock LayerNorm applies it in its own; the low-memory norm
saves its output, and z at the 0.25% of columns where it cannot be rebuilt from it. "bw" is the
bandwidth a compiled kernel reaches (bytes it must read and write / its time) as a fraction of
what ``torch.add`` reaches on tensors of the same shape and dtype. Writes the "kernels" section of ``benchmarks/RESULTS.md``.

    python -m benchmarks.op_speed [--repeats N] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import interleaved_times, markdown_table, paired_ratio, write_section
from lightning_lowmem import functional, kernels
from lightning_lowmem.ops.activation_registry import GELU_2BIT, SILU_2BIT

SHAPES = ((8, 197, 3072), (8, 197, 768), (2, 2048, 11008), (2, 2048, 4096))
DTYPES = (torch.float32, torch.bfloat16)


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


OPS: dict[str, tuple[Callable, Callable]] = {  # name -> (low-memory op, stock op)
    "ReGELU2 / gelu": (functional.regelu2, F.gelu),
    "ReSiLU2 / silu": (functional.resilu2, F.silu),
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
}


def phases(op: Callable, x: torch.Tensor, g: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Forward (recording the graph), backward alone (on a retained graph), both, and the eval forward
    (``torch.no_grad``: what validation runs)."""
    y = op(x)
    return {
        "fwd": lambda: op(x),
        "bwd": lambda: torch.autograd.grad(y, x, g, retain_graph=True),
        "fwd+bwd": lambda: torch.autograd.grad(op(x), x, g),
        "eval fwd": torch.no_grad()(lambda: op(x)),
    }


def kernel_calls(name: str, x: torch.Tensor, g: torch.Tensor) -> dict[str, tuple[Callable[[], object], int]]:
    """The compiled forward and backward kernel of an op, with the bytes each must move."""
    impl = kernels.implementation(x.device)
    n, size, dim = x.numel(), x.element_size(), x.shape[-1]
    rows = n // dim
    if name.startswith(("ReGELU2", "ReSiLU2")):
        step = GELU_2BIT if name.startswith("ReGELU2") else SILU_2BIT
        packed = impl.act_codes(x, step.thresholds)
        packed_bytes = packed.numel()
        return {
            "fwd": (lambda: impl.act_codes(x, step.thresholds), n * size + packed_bytes),
            "bwd": (lambda: impl.act_backward(g, packed, step.levels), 2 * n * size + packed_bytes),
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


def measure(name: str, shape: tuple[int, ...], dtype: torch.dtype, repeats: int) -> list[object]:
    low, stock = OPS[name]
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    g = torch.randn(shape, dtype=dtype)
    fns = {}
    for phase, fn in phases(low, x, g).items():
        fns[("low", phase)] = fn
    for phase, fn in phases(stock, x, g).items():
        fns[("stock", phase)] = fn
    detached = x.detach()
    fns[("add", "")] = lambda: torch.add(detached, g)  # allocates its output, like the kernels
    calls = kernel_calls(name, detached, g)
    for phase, (fn, _) in calls.items():
        fns[("kernel", phase)] = fn
    samples = interleaved_times(fns, repeats=repeats)
    t = {key: statistics.median(times) for key, times in samples.items()}
    add_bandwidth = 3 * math.prod(shape) * x.element_size() / t[("add", "")]
    ratio = {
        phase: paired_ratio(samples[("low", phase)], samples[("stock", phase)])
        for phase in ("fwd", "bwd", "fwd+bwd", "eval fwd")
    }
    bandwidth = {phase: nbytes / t[("kernel", phase)] / add_bandwidth for phase, (_, nbytes) in calls.items()}
    return [
        name,
        "x".join(map(str, shape)),
        str(dtype).removeprefix("torch."),
        f"{ratio['fwd'][0]:.2f}",
        f"{ratio['bwd'][0]:.2f}",
        "**{:.2f}** ({:.2f}-{:.2f})".format(*ratio["fwd+bwd"]),
        f"{ratio['eval fwd'][0]:.2f}",
        f"{t[('stock', 'fwd+bwd')] * 1e3:.1f}",
        f"{t[('low', 'fwd+bwd')] * 1e3:.1f}",
        f"{bandwidth['fwd']:.2f}",
        f"{bandwidth['bwd']:.2f}",
    ]


HEADER = [
    "op (low-mem / stock)",
    "shape",
    "dtype",
    "fwd",
    "bwd",
    "fwd+bwd (95% interval)",
    "eval fwd",
    "stock fwd+bwd ms",
    "low-mem fwd+bwd ms",
    "fwd kernel bw",
    "bwd kernel bw",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="first two shapes only, no RESULTS.md")
    args = parser.parse_args()
    active = kernels.backend("cpu")
    print(f"backend: {active}, threads: {torch.get_num_threads()}")
    # the first timing in a process is slow for low-mem and stock alike, and unevenly (the thread pool
    # starting, malloc growing its heap): a throwaway measurement of the first row comes first
    measure(next(iter(OPS)), SHAPES[0], DTYPES[0], args.repeats)
    rows = []
    for name in OPS:
        for shape in SHAPES[:2] if args.quick else SHAPES:
            for dtype in DTYPES:
                rows.append(measure(name, shape, dtype, args.repeats))
                print(" | ".join(rows[-1]), flush=True)
    table = markdown_table(HEADER, rows)
    print(table)
    if args.quick:
        return
    body = (
        f"### Compiled kernels (backend `{active}`)\n\n"
        "Time ratios low-memory / stock (below 1 = faster; targets: fwd+bwd <= 1.0): the median of the "
        f"per-round ratios of {args.repeats} interleaved rounds, fwd+bwd with its 95% bootstrap interval (how far "
        'this machine\'s noise lets the ratio be read); times in ms are medians. "bw": bytes the compiled kernel must move / its time, as a fraction of the bandwidth '
        "`torch.add` reaches on the same shape and dtype (the forward activation kernel computes the "
        "codes only; the op adds the stock activation). The norms are affine-free except in the rows with a "
        "frozen affine (weight and bias needing no gradient, as under LoRA; `|bias| < |weight|` but in 0.25% "
        "of the columns, as in pretrained norms): there the low-memory norm saves its output, which its readers "
        "save too, and `z` exactly at those columns; its backward rebuilds `z` from the output.\n\n" + table
    )
    write_section("kernels", body, f"python -m benchmarks.op_speed --repeats {args.repeats}")


if __name__ == "__main__":
    main()
