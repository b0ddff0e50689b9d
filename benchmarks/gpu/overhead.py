"""Stage ``overhead``: the host's microseconds per call of each of our ops against its stock counterpart.

At fine-tuning sizes a GPU step is bound by the host (``../shared/gpu/h100-2026-11-27``: ATen's dropout 14 us of CPU
per call, ours on Triton 42). Each op runs forward and backward on tensors small enough that the GPU never waits
for work (32 x 64, bf16), many times in a row without synchronising: the wall time per call is then the host's
(dispatch, Python, launches). On each backend the device runs; the same in a smoke run on the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import markdown_table
from benchmarks.gpu.ops import forced_backend, usable_backends
from lightning_lowmem import functional
from lightning_lowmem.nn import LowMemLinear, MSRMSNorm
from lightning_lowmem.ops.dropout import seeded_dropout

CALLS = 200


def cases(device: torch.device) -> dict[str, tuple[Callable, Callable, list[torch.Tensor]]]:
    """name -> (stock fwd, ours fwd, inputs): each a LoRA building block as a model's step calls it."""
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    gate, up = (torch.randn_like(x).requires_grad_() for _ in range(2))
    lora_a = torch.nn.Linear(64, 16, bias=False, device=device, dtype=torch.bfloat16)
    ours_a = LowMemLinear.from_linear(lora_a, dropout=0.05)
    norm = torch.nn.RMSNorm(64, device=device, dtype=torch.bfloat16)
    ours_norm = MSRMSNorm.from_module(norm)
    return {
        "dropout 0.1": (lambda: F.dropout(x, 0.1), lambda: seeded_dropout(x, 0.1), [x]),
        "LoRA A with dropout 0.05": (lambda: lora_a(F.dropout(x, 0.05)), lambda: ours_a(x), [x, lora_a.weight]),
        "RMSNorm": (lambda: norm(x), lambda: ours_norm(x), [x, norm.weight]),
        "SiLU (2-bit backward)": (lambda: F.silu(x), lambda: functional.resilu2(x), [x]),
        "SwiGLU product": (lambda: F.silu(gate) * up, lambda: functional.gated_activation(gate, up), [gate, up]),
    }


def per_call(fn: Callable[[], torch.Tensor], inputs: list[torch.Tensor], device: torch.device) -> float:
    """Host microseconds of one forward + backward, over :data:`CALLS` calls issued back to back."""

    def run() -> None:
        out = fn()
        torch.autograd.grad(out, inputs, torch.ones_like(out))

    for _ in range(5):  # warm: kernels compiled, the allocator's blocks cached
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(CALLS):
        run()
    seconds = time.perf_counter() - start  # the host's: the GPU keeps up with these sizes
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e6 * seconds / CALLS


def measure_overhead(device: torch.device) -> str:
    """Each op's host time per call, stock and ours on each backend (markdown)."""
    rows = []
    for backend in usable_backends(device):
        with forced_backend(backend, device):
            for name, (stock, ours, inputs) in cases(device).items():
                stock_us, ours_us = per_call(stock, inputs, device), per_call(ours, inputs, device)
                rows.append([name, backend, f"{stock_us:.1f}", f"{ours_us:.1f}", f"{ours_us / stock_us:.2f}"])
                print(" | ".join(rows[-1]), flush=True)
    header = [
        "op, forward + backward (32 x 64, bf16)",
        "backend",
        "stock us per call",
        "ours us per call",
        "ours / stock",
    ]
    return f"{CALLS} calls back to back, wall time per call (the host's).\n\n" + markdown_table(header, rows)
