"""Triton 3.8's compiler crashes (SIGSEGV in ``make_llir``) compiling this kernel for sm_90 at BLOCK 4096 with 8
warps (sm_80 compiles it): two block-wide fp32 accumulators summed over a loop, reduced after it, then a second
loop reading the reductions. It is the shape ``_norm_backward_kernel`` had; that kernel now reduces each chunk.
``python -m tests.triton_sm90_crash [80|90]`` prints "compiled" once a Triton fixes it (a bug report for Triton);
tests/test_kernels_triton.py runs it through ``lightning_lowmem.kernels.triton_aot``.
"""

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def kernel(g_ptr, z_ptr, out_ptr, dim, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    sum_g = tl.zeros([BLOCK], dtype=tl.float32)
    sum_gz = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, dim, BLOCK):
        g = tl.load(g_ptr + start + cols, mask=start + cols < dim, other=0.0)
        z = tl.load(z_ptr + start + cols, mask=start + cols < dim, other=0.0)
        sum_g += g
        sum_gz += g * z
    mean_g = tl.sum(sum_g, axis=0) / dim
    mean_gz = tl.sum(sum_gz, axis=0) / dim
    for start in range(0, dim, BLOCK):
        g = tl.load(g_ptr + start + cols, mask=start + cols < dim, other=0.0)
        z = tl.load(z_ptr + start + cols, mask=start + cols < dim, other=0.0)
        tl.store(out_ptr + start + cols, g - mean_g - z * mean_gz, mask=start + cols < dim)


if __name__ == "__main__":
    import sys

    signature = {"g_ptr": "*fp32", "z_ptr": "*fp32", "out_ptr": "*fp32", "dim": "i32", "BLOCK": "constexpr"}
    target = GPUTarget("cuda", int(sys.argv[1]) if len(sys.argv) > 1 else 90, 32)
    triton.compile(ASTSource(kernel, signature, {"BLOCK": 4096}), target=target, options={"num_warps": 8})
    print("compiled")
