"""Stage ``kernels``: every Triton kernel configuration of the ahead-of-time list, and the same calls on the CUDA C++
extension, run on the device against the PyTorch reference (:mod:`lightning_lowmem.kernels.torch_ops`).

The calls are :func:`~lightning_lowmem.kernels.triton_aot.launch_every_choice`'s, the ones whose launches make up the
ahead-of-time list: fp32, bf16 and fp16, every bit width, activation kind, row block and warp count. Each runs on the
backend and on the reference with copies of the same inputs; codes and dropout must agree bit for bit, floats within
one unit in the last place of a 16-bit result (1e-2) or 1e-5 relative in fp32. A failing or crashing call is
recorded and the check goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from benchmarks.common import markdown_table
from lightning_lowmem import kernels
from lightning_lowmem.kernels import build, library, torch_ops, triton_aot
from lightning_lowmem.surgery.example import tensors_in

EXACT_OPS = ("act_codes", "act_backward", "dropout", "gated_exceptions")


def _copied(value: Any) -> Any:
    """``value`` with every tensor in it cloned (launchers such as ``cross_entropy_grad_`` write their input)."""
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, value)


def _difference(got: Any, want: Any, exact: bool) -> tuple[float, bool]:
    """The largest difference of the outputs, relative to the reference's largest magnitude, and whether it is
    within the tolerance."""
    worst, within = 0.0, True
    for g, w in zip(tensors_in(got), tensors_in(want), strict=True):
        if g.shape != w.shape or g.dtype != w.dtype:
            return float("inf"), False
        if exact or not g.is_floating_point():
            equal = torch.equal(g.cpu(), w.cpu())
            worst, within = max(worst, 0.0 if equal else float("inf")), within and equal
            continue
        g64, w64 = g.double().cpu(), w.double().cpu()
        error = (g64 - w64).abs().max().item() if g.numel() else 0.0
        worst = max(worst, error / max(w64.abs().max().item() if w.numel() else 0.0, 1e-30))
        half = g.dtype in (torch.float16, torch.bfloat16)
        within = within and torch.allclose(g64, w64, rtol=1e-2 if half else 1e-5, atol=1e-2 if half else 1e-5)
    return worst, within


class Compared:
    """Stands in for a backend in :func:`launch_every_choice`: each launcher runs on the backend and on the reference
    with copies of the same inputs; one record per call."""

    def __init__(self, backend: str, ops: Any) -> None:
        self.backend, self.ops, self.records = backend, ops, []

    def __getattr__(self, op: str) -> Callable[..., Any]:
        def compare(*args: Any) -> Any:
            first = next(t for t in tensors_in(args) if t.is_floating_point())
            record = {"backend": self.backend, "op": op, "dtype": str(first.dtype).removeprefix("torch."),
                      "shape": "x".join(map(str, first.shape))}  # fmt: skip
            want = getattr(torch_ops, op)(*_copied(args))
            try:
                got = getattr(self.ops, op)(*_copied(args))
                if first.is_cuda:
                    torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001 - recorded: the check goes on
                self.records.append({**record, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"})
                return want
            record["difference"], record["ok"] = _difference(got, want, op in EXACT_OPS)
            self.records.append(record)
            return got

        return compare


def backends(device: torch.device) -> dict[str, Any]:
    """The compiled backends that run tensors on ``device``, by name, or the reason one cannot."""
    found: dict[str, Any] = {}
    triton = kernels._triton_module()
    found["triton"] = triton if not isinstance(triton, ImportError) else f"not importable: {triton}"
    if device.type == "cpu" and not isinstance(triton, ImportError) and not triton.INTERPRETED:
        found["triton"] = "runs CPU tensors only under TRITON_INTERPRET=1"
    started = time.perf_counter()
    loaded = build.load("cuda" if device.type == "cuda" else "cpu")
    name = "cuda" if device.type == "cuda" else "cpp"
    found[name] = f"did not build: {loaded}" if isinstance(loaded, build.BuildError) else library.OPS
    print(f"{name} extension: loaded in {time.perf_counter() - started:.0f} s", flush=True)
    return found


def check_kernels(device: torch.device) -> str:
    """Every configuration on every backend of ``device`` (markdown: a summary, and the failed calls)."""
    records: list[dict[str, Any]] = []
    notes = []
    for name, ops in backends(device).items():
        if isinstance(ops, str):
            notes.append(f"`{name}`: {ops}")
            continue
        compared = Compared(name, ops)
        triton_aot.launch_every_choice(compared, device)
        records += compared.records
    summary: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for record in records:
        summary.setdefault((record["backend"], record["op"], record["dtype"]), []).append(record)
    rows = []
    for (backend, op, dtype), calls in summary.items():
        failed = [c for c in calls if not c.get("ok")]
        worst = max((c.get("difference", float("inf")) for c in calls), default=0.0)
        rows.append([backend, op, dtype, len(calls), f"{worst:.1e}", len(failed),
                     "; ".join(sorted({c.get("error", f"shape {c['shape']}") for c in failed}))[:200]])  # fmt: skip
    table = markdown_table(
        ["backend", "op", "dtype", "calls", "largest difference (relative)", "failed", "failures"], rows
    )
    failed = sum(not r.get("ok") for r in records)
    if device.type == "cpu":
        notes.append("Triton's interpreter truncates fp32 -> bf16 where compiled Triton rounds to nearest even: its "
                     "bf16 differences here are the interpreter's.")  # fmt: skip
    lines = [f"{len(records)} calls, {failed} failed, against `torch_ops` on {device.type}.", *notes, "", table]
    failures = [record for record in records if not record.get("ok")]
    if failures:
        lines += ["", "Failed calls (the first 40):", "", *(f"- {record}" for record in failures[:40])]
    return "\n".join(lines)
