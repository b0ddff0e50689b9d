"""Triton as a GPU user runs it (no ``TRITON_INTERPRET``), checked without a GPU.

Run by tests/test_kernels_triton.py in a fresh process (the test process defines its Triton kernels
interpreted, and Triton cannot compile from such a process): reports, as one JSON line, the errors for
CPU tensors and the result of compiling every kernel launch of the contract to sm_90 machine code
(Triton bundles ptxas, so no GPU is needed). ``python -m tests.triton_compiled``
"""

from __future__ import annotations

import json

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.errors import TritonError
from triton.runtime.jit import mangle_type

from lightning_lowmem import kernels
from lightning_lowmem.kernels import torch_ops, triton_ops

TARGET = GPUTarget("cuda", 90, 32)


def refusals() -> list[str]:
    """The messages of the backend selection and of a kernel call for CPU tensors."""
    messages = []
    for call in (lambda: kernels.backend("cpu"), lambda: triton_ops.act_codes(torch.ones(4), (0.0,))):
        try:
            call()
        except RuntimeError as err:
            messages.append(str(err))
    return messages


class LaunchRecorder:
    """Stands in for a kernel: records each launch's arguments instead of running it."""

    def __init__(self, kernel: triton.runtime.JITFunction) -> None:
        self.kernel = kernel
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def launches() -> list[tuple[triton.runtime.JITFunction, tuple, dict]]:
    """Every kernel launch of the contract's functions: bf16 in every variant, fp16 and fp32 in one each."""
    recorders = {
        name: LaunchRecorder(getattr(triton_ops, name)) for name in dir(triton_ops) if name.endswith("_kernel")
    }
    for name, recorder in recorders.items():
        setattr(triton_ops, name, recorder)
    triton_ops.INTERPRETED = True  # let the wrappers take CPU tensors: the recorders run nothing
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(4, 64).to(dtype)
        variants = dtype == torch.bfloat16
        for bits in (1, 2, 4) if variants else (2,):
            thresholds = tuple(range((1 << bits) - 1))
            packed = torch_ops.act_codes(x, thresholds)
            triton_ops.act_codes(x, thresholds)
            triton_ops.act_backward(x, packed, (0.0,) * (len(thresholds) + 1))
        for center in (True, False) if variants else (True,):
            z, rstd = torch_ops.norm_forward(x, 64, 1e-5, center, dtype)
            triton_ops.norm_forward(x, 64, 1e-5, center, dtype)
            triton_ops.norm_backward(z, z, rstd, None, 64, center, torch.float32, False)
            triton_ops.norm_backward(z, z, rstd, rstd.new_ones(64), 64, center, torch.float32, True)
        triton_ops.norm_forward(x.float(), 64, 1e-5, True, dtype)
        for kind in torch_ops.KINDS if variants else ("silu",):
            for act in (None, x) if variants else (x,):
                triton_ops.gated_backward(x, x, x, kind, act)
        for p in (0.1, 0.5) if variants else (0.1,):  # the threshold an int32, then an int64
            triton_ops.dropout(x, p, torch.tensor([1]))
    for cap in (0.0, 30.0):  # the head's step: fp32 logits only
        triton_ops.cross_entropy_grad_(torch.randn(4, 64), torch.tensor([1, 2, -100, 3]), -100, 0.1, cap)
    return [(r.kernel, args, kwargs) for r in recorders.values() for args, kwargs in r.launches]


def compile_all() -> tuple[list[str], list[str]]:
    """Kernel names compiled, and a line for each launch that failed to compile."""
    compiled, failures = [], []
    for kernel, args, kwargs in launches():
        options = {"num_warps": kwargs.pop("num_warps", 4)}
        constexprs = {**{name: arg for name, arg in zip(kernel.arg_names, args) if arg is None}, **kwargs}
        signature = {name: mangle_type(arg) for name, arg in zip(kernel.arg_names, args)}
        signature |= dict.fromkeys(kwargs, "constexpr")
        try:
            binary = triton.compile(ASTSource(kernel, signature, constexprs), target=TARGET, options=options)
            assert binary.asm["cubin"], "no machine code"
            compiled.append(kernel.__name__)
        except (TritonError, RuntimeError, AssertionError) as err:  # reported: the test lists every failure
            failures.append(f"{kernel.__name__} {signature} {constexprs}: {str(err).strip().splitlines()[-1]}")
    return compiled, failures


if __name__ == "__main__":
    messages = refusals()  # before compile_all replaces the kernels by recorders
    compiled, failures = compile_all()
    print(json.dumps({"refusals": messages, "compiled": compiled, "failures": failures}))
