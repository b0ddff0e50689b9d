"""Saved-for-backward bytes per element of each low-memory op against its stock op.

    python benchmarks/saved_bytes.py [--smoke]

Measured with SavedTensorMeter; deterministic, device independent.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_section
from lightning_lowmem.functional import ms_layer_norm, ms_rms_norm, regelu2, resilu2
from lightning_lowmem.memory import SavedTensorMeter

OPS = {
    "regelu2 vs F.gelu": (regelu2, F.gelu),
    "resilu2 vs F.silu": (resilu2, F.silu),
    "ms_layer_norm vs F.layer_norm": (
        lambda x: ms_layer_norm(x, x.shape[-1]),
        lambda x: F.layer_norm(x, x.shape[-1:]),
    ),
    "ms_rms_norm vs F.rms_norm": (
        lambda x: ms_rms_norm(x, x.shape[-1]),
        lambda x: F.rms_norm(x, x.shape[-1:], eps=1e-6),
    ),
}
# A norm's saving only shows next to its consumer: the pair saves one tensor instead of two.
NORM_THEN_LINEAR = {
    f"{name.replace(' vs ', ' + linear vs ')} + linear": (
        lambda x, norm=ours: F.linear(norm(x), _weight(x)),
        lambda x, norm=stock: F.linear(norm(x), _weight(x)),
    )
    for name, (ours, stock) in list(OPS.items())[2:]
}
OPS.update(NORM_THEN_LINEAR)


def _weight(x: torch.Tensor) -> torch.nn.Parameter:
    """A trainable consumer (16 outputs) of the input's dtype; parameters are not counted."""
    return torch.nn.Parameter(torch.zeros(16, x.shape[-1], dtype=x.dtype))


def saved_bytes(fn, x: torch.Tensor) -> int:
    with SavedTensorMeter() as meter:
        fn(x)
    return meter.total_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no RESULTS.md update")
    args = parser.parse_args()
    shapes = [(2, 5, 12)] if args.smoke else [(8, 197, 3072), (4, 512, 4096)]
    rows = []
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, dtype=dtype, requires_grad=True)
            for name, (ours, stock) in OPS.items():
                ours_bytes, stock_bytes = saved_bytes(ours, x), saved_bytes(stock, x)
                rows.append(
                    [
                        name,
                        "x".join(map(str, shape)),
                        str(dtype).removeprefix("torch."),
                        f"{ours_bytes / x.numel():.4f}",
                        f"{stock_bytes / x.numel():.4f}",
                        f"{ours_bytes:,}",
                        f"{stock_bytes:,}",
                    ]
                )
    header = ["op", "shape", "dtype", "ours B/elem", "stock B/elem", "ours bytes", "stock bytes"]
    table = markdown_table(header, rows)
    print(table)
    if not args.smoke:
        body = (
            "## Saved-for-backward bytes per element (SavedTensorMeter)\n\n"
            "A norm alone saves about as much as the stock norm; the `+ linear` rows show the point: the MS "
            "norm's saved output is the very tensor the next (trainable) linear saves, so the pair costs one "
            "activation plus an fp32 rstd per row, where the stock pair saves the norm's input as well.\n\n" + table
        )
        write_section("saved_bytes", body, "python benchmarks/saved_bytes.py")


if __name__ == "__main__":
    main()
