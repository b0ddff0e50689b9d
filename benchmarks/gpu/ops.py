"""Stage ``ops``: every op, forward + backward, against the stock op and Liger Kernel's fused op where one exists
(``pip install liger-kernel``; left out when absent), on each backend the device runs; bf16, the paper's shapes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from benchmarks.common import interleaved_median, markdown_table
from lightning_lowmem import functional, kernels


def gated(activation: str, mode: str) -> Callable:
    return lambda gate, up: functional.gated_activation(gate, up, activation, mode)


# name -> (shape at the paper's settings, stock op, {our op: function}, Liger Kernel's function name)
OPS = {
    "GELU": ((64, 197, 3072), F.gelu, {"ReGELU2": functional.regelu2}, None),
    "SiLU": ((4, 512, 11008), F.silu, {"ReSiLU2": functional.resilu2}, None),
    "LayerNorm": (
        (64, 197, 768),
        lambda x: F.layer_norm(x, x.shape[-1:]),
        {"MS-LN": lambda x: functional.ms_layer_norm(x, x.shape[-1:])},
        "liger_layer_norm",
    ),
    "RMSNorm": (
        (4, 512, 4096),
        lambda x: F.rms_norm(x, x.shape[-1:], eps=1e-6),
        {"MS-RMSNorm": lambda x: functional.ms_rms_norm(x, x.shape[-1:])},
        "liger_rms_norm",
    ),
    "SwiGLU product": (
        (4, 512, 11008),
        lambda gate, up: F.silu(gate) * up,
        {"fused, mode gate_up": gated("silu", "gate_up"), "fused, mode gate": gated("silu", "gate")},
        "liger_swiglu",
    ),
    "GeGLU (tanh) product": (
        (4, 512, 11008),
        lambda gate, up: F.gelu(gate, approximate="tanh") * up,
        {"fused, mode gate_up": gated("gelu_tanh", "gate_up"), "fused, mode gate": gated("gelu_tanh", "gate")},
        "liger_geglu",
    ),
}


@contextlib.contextmanager
def forced_backend(name: str | None, device: torch.device) -> Iterator[None]:
    """LIGHTNING_LOWMEM_BACKEND=name inside the block (None: unset) for the ops on ``device``, restored after."""
    old = os.environ.pop(kernels.ENV_VAR, None)
    if name is not None:
        os.environ[kernels.ENV_VAR] = name
    try:
        kernels.backend(device)  # the ops on the device follow the variable from the next choice on
        yield
    finally:
        os.environ.pop(kernels.ENV_VAR, None)
        if old is not None:
            os.environ[kernels.ENV_VAR] = old
        kernels.backend(device)


def usable_backends(device: torch.device) -> list[str]:
    """The compiled backends that run tensors on ``device`` here."""
    usable = []
    for name in ("triton", "cuda") if device.type == "cuda" else ("cpp", "triton"):
        try:
            with forced_backend(name, device):
                pass
        except RuntimeError as err:
            print(f"backend {name}: not measured ({str(err).splitlines()[0]})", flush=True)
        else:
            usable.append(name)
    return usable


def liger_op(name: str | None, dim: int, device: torch.device) -> Callable | None:
    """Liger Kernel's fused op (norms with a unit affine: Liger has no affine-free norm), if installed."""
    if name is None or device.type != "cuda":
        return None
    try:
        from liger_kernel.transformers import functional as liger
    except ImportError:
        return None
    op = getattr(liger, name)
    ones = torch.ones(dim, device=device, dtype=torch.bfloat16)
    if name == "liger_layer_norm":
        return lambda x: op(x, ones, torch.zeros_like(ones), 1e-5)
    if name == "liger_rms_norm":
        return lambda x: op(x, ones, 1e-6)
    return op


def time_ops(device: torch.device, shrink: int, repeats: int) -> str:
    """fwd+bwd time of each op's implementations, interleaved; one row per implementation (markdown)."""
    backends = usable_backends(device)
    rows = []
    for name, (shape, stock, ours, liger_name) in OPS.items():
        shape = (*shape[:-1], shape[-1] // shrink)
        n_inputs = 2 if name.endswith("product") else 1
        inputs = [torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(n_inputs)]
        grad = torch.randn(shape, device=device, dtype=torch.bfloat16)

        def fwd_bwd(fn: Callable, backend: str | None = None, inputs=inputs, grad=grad) -> Callable[[], object]:
            def run() -> object:
                with forced_backend(backend, device):
                    return torch.autograd.grad(fn(*inputs), inputs, grad)

            return run

        candidates = {"stock": fwd_bwd(stock)}
        candidates |= {f"{op} ({b})": fwd_bwd(fn, b) for op, fn in ours.items() for b in backends}
        liger = liger_op(liger_name, shape[-1], device)
        if liger is not None:
            candidates["Liger Kernel"] = fwd_bwd(liger)
        times = interleaved_median(candidates, repeats=repeats)
        for implementation, seconds in times.items():
            ratio = f"{seconds / times['stock']:.2f}"
            rows.append([name, "x".join(map(str, shape)), implementation, f"{seconds * 1e3:.3f}", ratio])
            print(" | ".join(rows[-1]), flush=True)
    table = markdown_table(["op", "shape (bf16)", "implementation", "fwd+bwd ms", "vs stock"], rows)
    return (
        f"Backends measured on {device.type}: {', '.join(backends)}. Stock norms are affine-free like ours; Liger "
        "Kernel's norms apply a unit affine (they have no affine-free form).\n\n" + table
    )
