"""Compiled kernels against the pure-PyTorch reference, the stock modules, and the loader's guarantees."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lightning_lowmem import functional, kernels
from lightning_lowmem.kernels import build, library, torch_ops
from lightning_lowmem.registry.activations import GELU_2BIT, SILU_2BIT

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
STEPS = {"gelu": GELU_2BIT, "silu": SILU_2BIT}
# Per backend: empty, shorter than a byte, odd tails, both sides of its block (C++: the 4096-element staging
# block, then several parallel chunks; CUDA: 256 threads of one byte each; Triton: 1024 elements a program).
SIZES = {
    "cpp": [0, 1, 3, 4, 5, 4095, 4097, 3 * 4096 + 7, 200_003],
    "cuda": [0, 1, 3, 4, 5, 1023, 1025, 200_003],
    "triton": [0, 1, 3, 4, 5, 1023, 1025, 3 * 1024 + 7],
}
# Rows: none, of one element, odd, non-power-of-two, longer than a block (4096 for C++ and Triton), LLaMA's 11008;
# five rows of 768 and of 4099 elements: the C++ frozen-norm backward takes fp32 rows of up to 4 KB one by one,
# longer ones (and bf16 ones) four at a time, the fifth alone.
NORM_SHAPES = [(0, 8), (1, 1), (3, 7), (5, 768), (2, 3, 1001), (9, 33), (5, 4099), (1, 11008)]


def spread(shape, dtype, device) -> torch.Tensor:
    """Values over all four code segments, with the thresholds themselves in it."""
    x = torch.randn(shape, dtype=torch.float64) * 5
    flat = x.view(-1)
    thresholds = torch.tensor(GELU_2BIT.thresholds + SILU_2BIT.thresholds, dtype=torch.float64)
    k = min(flat.numel(), thresholds.numel())
    flat[:k] = thresholds[:k]
    return x.to(dtype=dtype, device=device)


def half_tolerance(dtype: torch.dtype) -> dict:
    """Results rounded to a 16-bit type may differ by one unit in the last place."""
    return {"atol": 1e-2, "rtol": 1e-2} if dtype in (torch.float16, torch.bfloat16) else {}


@pytest.mark.parametrize("table", STEPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_codes_and_backward_match_reference_bit_for_bit(kernel_backend, table, dtype):
    ext, step = kernel_backend.module, STEPS[table]
    for n in SIZES[kernel_backend.name]:
        x = spread((n,), dtype, kernel_backend.device)
        packed = ext.act_codes(x, step.thresholds)
        assert packed.dtype == torch.uint8 and torch.equal(packed, torch_ops.act_codes(x, step.thresholds)), n
        g = torch.randn(n, dtype=torch.float64).to(dtype=dtype, device=kernel_backend.device)
        got = ext.act_backward(g, packed, step.levels)
        assert got.dtype == dtype and torch.equal(got, torch_ops.act_backward(g, packed, step.levels)), n


# around ATen's parallel grain (32768 elements per task) and a task's vector tail, in one and two threads; two
# threads split 8 * 197 * 768 at a multiple of 64 elements (the codes packed in the SiLU's loop) and the sizes
# from 65537 on elsewhere (the codes packed by blocks)
FORWARD_SIZES = [1, 7, 63, 64, 65, 1000, 32767, 32768, 32769, 65537, 3 * 32768 + 17, 8 * 197 * 768, 8 * 197 * 768 + 5]


@pytest.mark.parametrize("kind", torch_ops.KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_act_forward_is_the_stock_activation_bit_for_bit_and_its_codes(kernel_backend, kind, dtype, threads):
    """The CPU kernels compute fp32 SiLU and its codes in one pass, repeating ATen's own kernel: its output must
    be F.silu's to the bit, whatever the size, the tails and the threads."""
    if kernel_backend.name == "triton" and dtype == torch.float64:
        pytest.skip("fp64 runs the torch path on Triton")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for bits, step in ((2, SILU_2BIT), (1, (0.0,)), (4, tuple(float(t) for t in torch.linspace(-4, 4, 15)))):
            thresholds = step.thresholds if bits == 2 else step
            for n in FORWARD_SIZES if kernel_backend.name == "cpp" else FORWARD_SIZES[:6]:  # the interpreter is slow
                x = spread((n,), dtype, kernel_backend.device)
                y, packed = kernel_backend.module.act_forward(x, kind, thresholds)
                assert torch.equal(y, torch_ops.stock_activation(x, kind)), (n, bits)
                assert torch.equal(packed, torch_ops.act_codes(x, thresholds)), (n, bits)
                assert y.dtype == dtype
    finally:
        torch.set_num_threads(previous)


def test_codes_of_non_contiguous_inputs(kernel_backend):
    ext, step, device = kernel_backend.module, GELU_2BIT, kernel_backend.device
    base = spread((37, 64), torch.float32, device)
    for x in (base.t(), base[:, ::3], base.unsqueeze(0).expand(2, -1, -1)):
        packed = ext.act_codes(x, step.thresholds)
        assert torch.equal(packed, torch_ops.act_codes(x, step.thresholds))
        grad = torch.randn(x.shape[-1], device=device).expand(x.shape)  # stride 0, as from a broadcast
        got = ext.act_backward(grad, packed, step.levels)
        assert got.shape == x.shape and torch.equal(got, torch_ops.act_backward(grad, packed, step.levels))


@pytest.mark.parametrize("center", [True, False], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize(
    "dtype,out_dtype",
    [(d, d) for d in DTYPES] + [(torch.float32, torch.bfloat16), (torch.float32, torch.float16)],
)
def test_norm_matches_reference(kernel_backend, center, dtype, out_dtype):
    ext, device = kernel_backend.module, kernel_backend.device
    for shape in [*NORM_SHAPES, (301, 40)]:  # and the column sums of several chunks of rows
        x = (torch.randn(shape, dtype=torch.float64) * 3 + 2).to(dtype=dtype, device=device)
        dim = shape[-1]
        z, rstd = ext.norm_forward(x, dim, 1e-5, center, out_dtype)
        ref_z, ref_rstd = torch_ops.norm_forward(x, dim, 1e-5, center, out_dtype)
        assert z.dtype == out_dtype and rstd.dtype == ref_rstd.dtype and rstd.shape == ref_rstd.shape
        torch.testing.assert_close(z, ref_z, **half_tolerance(out_dtype))
        torch.testing.assert_close(rstd, ref_rstd)
        g = torch.randn(shape, dtype=torch.float64).to(dtype=out_dtype, device=device)
        scale = torch.randn(dim, dtype=rstd.dtype, device=device)
        for affine in (None, scale):
            for column_sums in (False, True):
                got, sums = ext.norm_backward(g, ref_z, ref_rstd, affine, dim, center, dtype, column_sums)
                want, want_sums = torch_ops.norm_backward(g, ref_z, ref_rstd, affine, dim, center, dtype, column_sums)
                assert got.dtype == dtype and sums.dtype == rstd.dtype and sums.shape == want_sums.shape
                torch.testing.assert_close(got, want, **half_tolerance(out_dtype))
                torch.testing.assert_close(sums, want_sums, rtol=1e-5, atol=1e-5 * (g.numel() // dim + 1))


@pytest.mark.parametrize(
    "dtype,out_dtype", [(d, d) for d in DTYPES] + [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
def test_norm_affine_forward_is_norm_forward_then_its_affine(kernel_backend, dtype, out_dtype):
    """z and rstd as norm_forward's, y the affine of z as stored (to one rounding: a compiler may fuse the
    multiply-add, in our kernels as in ATen's), with scale and shift, either alone."""
    ext, device = kernel_backend.module, kernel_backend.device
    acc = torch_ops.accumulate_dtype(dtype)
    close = half_tolerance(out_dtype) or {"rtol": 1e-6, "atol": 1e-5}
    for shape in NORM_SHAPES:
        x = (torch.randn(shape, dtype=torch.float64) * 3 + 2).to(dtype=dtype, device=device)
        dim = shape[-1]
        scale, shift = (torch.randn(dim, dtype=acc, device=device) * 2 for _ in range(2))
        z, rstd = ext.norm_forward(x, dim, 1e-5, True, out_dtype)
        for affine in ((scale, shift), (scale, None), (None, shift)):
            y, z_too, rstd_too = ext.norm_affine_forward(x, dim, 1e-5, True, out_dtype, *affine)
            assert torch.equal(z_too, z) and torch.equal(rstd_too, rstd), shape
            assert y.dtype == out_dtype and y.shape == x.shape and (y.numel() == 0 or y.data_ptr() != z_too.data_ptr())
            torch.testing.assert_close(y, torch_ops.affine(z, *affine), **close)


@pytest.mark.parametrize("center", [True, False], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype,out_dtype", [(d, d) for d in DTYPES] + [(torch.float32, torch.bfloat16)])
def test_norm_output_ops_match_reference(kernel_backend, center, dtype, out_dtype):
    """A norm that saves its output y: y, rstd and the exact columns (scale 0, |shift| > |scale|) as the
    reference's; the input gradient rebuilt from y as the reference rebuilds it, and as norm_backward's from
    the unrounded z, those columns included (without them a zero scale gives NaN)."""
    ext, device = kernel_backend.module, kernel_backend.device
    acc = torch_ops.accumulate_dtype(dtype)
    for shape in NORM_SHAPES:
        x = (torch.randn(shape, dtype=torch.float64) * 3 + 2).to(dtype=dtype, device=device)
        dim = shape[-1]
        scale, shift = torch.randn(dim, dtype=acc, device=device), torch.randn(dim, dtype=acc, device=device) / 2
        scale[::5] = 0.0
        z, z_rstd = torch_ops.norm_forward(x, dim, 1e-5, center, acc)
        g = torch.randn(shape, dtype=torch.float64).to(dtype=out_dtype, device=device)
        for affine in ((scale, shift), (scale, None), (None, shift)):
            columns = ext.norm_exact_columns(*affine)
            assert torch.equal(columns, torch_ops.norm_exact_columns(*affine)) and columns.dtype == torch.long
            y, rstd, exact = ext.norm_output_forward(x, dim, 1e-5, center, out_dtype, *affine, columns)
            ref = torch_ops.norm_output_forward(x, dim, 1e-5, center, out_dtype, *affine, columns)
            assert y.dtype == exact.dtype == out_dtype and exact.shape == (z_rstd.numel(), columns.numel())
            for got, want in zip((y, rstd, exact), ref):
                torch.testing.assert_close(got, want, **half_tolerance(out_dtype))
            grad_input = ext.norm_output_backward(g, y, rstd, *affine, columns, exact, dim, center, dtype)
            ref_input = torch_ops.norm_output_backward(g, y, rstd, *affine, columns, exact, dim, center, dtype)
            from_z, _ = torch_ops.norm_backward(g, z, z_rstd, affine[0], dim, center, dtype, False)
            assert grad_input.dtype == dtype and grad_input.isfinite().all()
            torch.testing.assert_close(grad_input, ref_input, **half_tolerance(out_dtype))
            torch.testing.assert_close(
                grad_input, from_z, **(half_tolerance(out_dtype) or {"rtol": 1e-4, "atol": 1e-5})
            )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_output_ops_widen_an_affine_in_the_input_dtype(kernel_backend, dtype):
    """The output ops take a frozen half / bfloat16 affine as it is (no cast before every call): the same columns,
    y, exact and input gradient, bit for bit, as with the affine widened to fp32 first; rows of 768 and 4099
    elements (the kernels' vector and one-by-one paths). Another dtype is refused by name."""
    ext, device = kernel_backend.module, kernel_backend.device
    for rows, dim in ((5, 768), (3, 4099)):
        x = (torch.randn(rows, dim, dtype=torch.float64) * 3 + 2).to(dtype=dtype, device=device)
        g = torch.randn(rows, dim, dtype=torch.float64).to(dtype=dtype, device=device)
        scale = (torch.randn(dim, device=device) + 1).to(dtype)
        shift = (torch.randn(dim, device=device) / 2).to(dtype)
        scale[::97] = 0.0
        for narrow in ((scale, shift), (scale, None), (None, shift)):
            wide = tuple(None if t is None else t.float() for t in narrow)
            columns = ext.norm_exact_columns(*narrow)
            assert torch.equal(columns, ext.norm_exact_columns(*wide)) and columns.numel() > 0
            got = ext.norm_output_forward(x, dim, 1e-5, True, dtype, *narrow, columns)
            want = ext.norm_output_forward(x, dim, 1e-5, True, dtype, *wide, columns)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            y, rstd, exact = got
            grad_input = ext.norm_output_backward(g, y, rstd, *narrow, columns, exact, dim, True, dtype)
            assert torch.equal(
                grad_input, ext.norm_output_backward(g, y, rstd, *wide, columns, exact, dim, True, dtype)
            )
    with pytest.raises(ValueError, match=f"norm_output_forward: expected {dim} scale values of dtype .* or .*got"):
        ext.norm_output_forward(x, dim, 1e-5, True, dtype, scale.double(), None, columns)
    with pytest.raises(ValueError, match=f"norm_output_backward: expected {dim} shift values of dtype"):
        ext.norm_output_backward(g, y, rstd, None, shift[1:], columns, exact, dim, True, dtype)


@pytest.mark.parametrize("affine", ["scale", "shift", "scale and shift"])
@pytest.mark.parametrize(("product_dtype", "weight_dtype"), [(torch.float32,) * 2, (torch.bfloat16, torch.float32),
                                                             (torch.bfloat16,) * 2, (torch.float16,) * 2])  # fmt: skip
def test_affine_weight_grad_matches_reference(kernel_backend, affine, product_dtype, weight_dtype):
    """A linear's weight gradient from a norm's shared ``z`` (``grad^T z`` scaled, plus the outer product of the
    gradient's sum and the shift), in the weight's dtype: the reference's, to one rounding (a fused multiply-add)."""
    device = kernel_backend.device
    for rows, cols in [(96, 40), (1, 1), (3, 1100), (0, 8)]:
        product = torch.randn(rows, cols, device=device).to(product_dtype)
        scale = torch.rand(cols, device=device) + 0.5 if "scale" in affine else None
        shift = torch.randn(cols, device=device) if "shift" in affine else None
        total = torch.randn(rows, device=device).to(product_dtype) if shift is not None else None
        got = kernel_backend.module.affine_weight_grad(product, total, scale, shift, weight_dtype)
        want = torch_ops.affine_weight_grad(product, total, scale, shift, weight_dtype)
        assert got.dtype == weight_dtype and got.shape == (rows, cols)
        ulp = {torch.float32: 3e-7, torch.bfloat16: 8e-3, torch.float16: 1e-3}[weight_dtype]
        torch.testing.assert_close(got, want, rtol=ulp, atol=1e-6)


def test_affine_weight_grad_refuses_bad_arguments(kernel_backend):
    product = torch.randn(4, 6, device=kernel_backend.device)
    columns, rows = torch.ones(6, device=product.device), torch.ones(4, device=product.device)
    for ops in (kernel_backend.module, torch_ops):
        with pytest.raises(ValueError, match="affine_weight_grad: needs a scale or a shift"):
            ops.affine_weight_grad(product, None, None, None, torch.float32)
        with pytest.raises(ValueError, match="affine_weight_grad: total .* comes with a shift"):
            ops.affine_weight_grad(product, rows, columns, None, torch.float32)
        with pytest.raises(ValueError, match="affine_weight_grad: expected 6 scale values of dtype"):
            ops.affine_weight_grad(product, None, columns.double(), None, torch.float32)
        with pytest.raises(ValueError, match="affine_weight_grad: expected 4 total values"):
            ops.affine_weight_grad(product, rows[:3], None, columns, torch.float32)


def test_norm_non_contiguous_inputs(kernel_backend):
    ext, device = kernel_backend.module, kernel_backend.device
    x = torch.randn(48, 40, device=device).t()  # rows of 48, strided
    z, rstd = ext.norm_forward(x, 48, 1e-5, True, x.dtype)
    torch.testing.assert_close(z, F.layer_norm(x, (48,)))
    grad = torch.randn(48, device=device).expand(40, 48)
    ref_z, ref_rstd = torch_ops.norm_forward(x.contiguous(), 48, 1e-5, True, x.dtype)
    scale = torch.randn(96, device=device)[::2]  # strided too
    for got, want in zip(
        ext.norm_backward(grad, z, rstd, scale, 48, True, x.dtype, True),
        torch_ops.norm_backward(grad, ref_z, ref_rstd, scale, 48, True, x.dtype, True),
    ):
        torch.testing.assert_close(got, want)


def test_ops_on_compiled_backend_match_stock_modules(kernel_backend, monkeypatch):
    """The public ops on a compiled backend in fp64: exact forward, norm gradients of the stock norms."""
    monkeypatch.setenv(kernels.ENV_VAR, kernel_backend.name)
    x = torch.randn(6, 2, 33, dtype=torch.float64, device=kernel_backend.device, requires_grad=True)
    assert torch.equal(functional.regelu2(x), F.gelu(x)) and torch.equal(functional.resilu2(x), F.silu(x))
    for ours, stock in (
        (lambda t: functional.ms_layer_norm(t, (33,)), lambda t: F.layer_norm(t, (33,))),
        (lambda t: functional.ms_rms_norm(t, (33,)), lambda t: F.rms_norm(t, (33,), eps=1e-6)),
    ):
        torch.testing.assert_close(ours(x), stock(x))
        g = torch.randn_like(x)
        torch.testing.assert_close(torch.autograd.grad(ours(x), x, g)[0], torch.autograd.grad(stock(x), x, g)[0])
        assert torch.autograd.gradcheck(ours, (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_on_compiled_backend_agree_with_the_reference_backend(kernel_backend, monkeypatch, dtype):
    """Training dtypes: each op's output and input gradient on a compiled backend equal the pure-PyTorch
    backend's (bit for bit; the norms and the gated backward's formulas within rounding)."""
    x = (torch.randn(4, 3, 40, dtype=torch.float64) * 3).to(dtype=dtype, device=kernel_backend.device)
    weight, bias = torch.rand(40, device=x.device) + 0.5, torch.randn(40, device=x.device)  # frozen: y is saved
    exact = {"regelu2": functional.regelu2, "resilu2 4-bit": lambda t: functional.resilu2(t, bits=4)}
    close = {
        "ms_layer_norm": lambda t: functional.ms_layer_norm(t, (40,)),
        "ms_rms_norm": lambda t: functional.ms_rms_norm(t, (40,)),
        "ms_layer_norm, frozen affine": lambda t: functional.ms_layer_norm(t, (40,), weight=weight, bias=bias),
        "gated gate_up": lambda t: functional.gated_activation(t[..., :20], t[..., 20:], "gelu", "gate_up"),
        "gated gate": lambda t: functional.gated_activation(t[..., :20], t[..., 20:], "silu", "gate"),
    }

    def output_and_grad(backend: str, op) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setenv(kernels.ENV_VAR, backend)
        kernels.backend(x.device)  # chosen again: the ops follow it
        leaf = x.clone().requires_grad_()
        out = op(leaf)
        weights = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out).to(dtype)
        return out, torch.autograd.grad(out, leaf, weights)[0]

    for name, op in {**exact, **close}.items():
        got, want = output_and_grad(kernel_backend.name, op), output_and_grad("torch", op)
        for g, w in zip(got, want):
            if name in exact:
                assert torch.equal(g, w), name
            else:
                torch.testing.assert_close(g, w, **half_tolerance(dtype), msg=name)


def test_bad_arguments_raise_naming_the_op(kernel_backend):
    ext, device = kernel_backend.module, kernel_backend.device
    ints = torch.arange(8, device=device)
    with pytest.raises(TypeError, match="act_codes: unsupported dtype"):
        ext.act_codes(ints, GELU_2BIT.thresholds)
    with pytest.raises(ValueError, match="thresholds must be ascending"):
        ext.act_codes(ints.float(), GELU_2BIT.thresholds[::-1])
    with pytest.raises(ValueError, match="act_backward: 1 packed bytes do not hold 8 codes"):
        ext.act_backward(ints.float(), torch.zeros(1, dtype=torch.uint8, device=device), GELU_2BIT.levels)
    with pytest.raises(TypeError, match="norm_forward: unsupported dtype"):
        ext.norm_forward(ints, 8, 1e-5, True, torch.float32)
    with pytest.raises(ValueError, match="norm_forward: cannot normalize 8 elements over trailing size 3"):
        ext.norm_forward(ints.float(), 3, 1e-5, True, torch.float32)
    with pytest.raises(ValueError, match="norm_affine_forward: needs a scale or a shift"):
        ext.norm_affine_forward(ints.float(), 8, 1e-5, True, torch.float32, None, None)
    with pytest.raises(ValueError, match="norm_affine_forward: expected 8 shift values of dtype"):
        ext.norm_affine_forward(ints.float(), 8, 1e-5, True, torch.float32, None, torch.ones(3, device=device))
    with pytest.raises(ValueError, match="norm_output_forward: needs a scale or a shift"):
        ext.norm_output_forward(ints.float(), 8, 1e-5, True, torch.float32, None, None, ints)
    with pytest.raises(ValueError, match="norm_exact_columns: needs a scale or a shift"):
        ext.norm_exact_columns(None, None)
    if kernel_backend.name == "cpp":  # indices into the rows: checked (the reference would index anyway)
        scale = torch.tensor([0.0, 1, 0, 1])
        columns = ext.norm_exact_columns(scale, None)
        y, rstd, exact = ext.norm_output_forward(
            ints.float().view(2, 4), 4, 1e-5, True, torch.float32, scale, None, columns
        )
        assert columns.tolist() == [0, 2] and exact.shape == (2, 2)
        for bad in ([2, 0], [0, 0], [0, 4], [-1, 0]):
            with pytest.raises(ValueError, match="norm_output_backward: columns must be ascending indices in"):
                ext.norm_output_backward(y, y, rstd, None, None, torch.tensor(bad), exact, 4, True, torch.float32)
            with pytest.raises(ValueError, match="norm_output_forward: columns must be ascending indices in"):
                ext.norm_output_forward(y, 4, 1e-5, True, torch.float32, scale, None, torch.tensor(bad))
        with pytest.raises(ValueError, match=r"norm_output_backward: expected exact of shape \[2, 2\]"):
            ext.norm_output_backward(y, y, rstd, None, None, columns, exact[:1], 4, True, torch.float32)
    if kernel_backend.name == "cpp" and torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="must be on cpu"):
            ext.act_codes(ints.float().cuda(), GELU_2BIT.thresholds)


def test_backend_reports_what_runs(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.backend("cpu") == "cpp" and kernels.implementation(torch.device("cpu")) is library.OPS
    assert torch._C._dispatch_has_kernel_for_dispatch_key("lowmem::act_codes", "CPU")  # registered by the extension
    assert kernels.backend("meta") == "torch"
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert kernels.backend("cpu") == "torch" and kernels.implementation(torch.device("cpu")) is torch_ops
    monkeypatch.setenv(kernels.ENV_VAR, "fortran")
    with pytest.raises(ValueError, match="is not one of"):
        kernels.backend("cpu")


def test_ops_run_the_backend_chosen_for_their_device(monkeypatch):
    """The variable is read when a device's backend is chosen (its first op, or a backend() call), not per op:
    the ops follow the last choice, also after the variable changed."""
    cpu = torch.device("cpu")
    x = torch.randn(3, 8, requires_grad=True)
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    first = functional.ms_layer_norm(x, (8,), weight=torch.ones(8))  # the first op on the CPU chooses
    assert first.grad_fn.name() == "MemorySharingNormFunctionBackward"  # the Python function of the torch backend
    monkeypatch.delenv(kernels.ENV_VAR)
    assert kernels.implementation(cpu) is torch_ops and not kernels.autograd_in_cpp(torch.empty(0, device=cpu))
    assert kernels.backend(cpu) == "cpp"  # chosen again
    assert kernels.implementation(cpu) is library.OPS and kernels.autograd_in_cpp(torch.empty(0, device=cpu))
    y = functional.ms_layer_norm(x, (8,), weight=torch.ones(8))
    assert y.grad_fn.name().startswith("torch::autograd::CppNode")  # lowmem::ms_norm's C++ function
    monkeypatch.setenv(kernels.ENV_VAR, "fortran")
    with pytest.raises(ValueError, match="is not one of"):
        kernels.backend(cpu)
    assert kernels.implementation(cpu) is library.OPS  # a refused choice changes nothing


def test_cuda_tensors_run_the_cuda_extension_by_default_and_triton_where_it_cannot_be_built(monkeypatch):
    """CUDA tensors: the CUDA extension first (autograd in C++, one path with the CPU's), Triton where no CUDA build
    can be had (or when forced), and CPU tensors on Triton only interpreted; no GPU here, so one is faked, with a
    compiled (not interpreted) Triton."""
    triton_ops = kernels._triton_module()
    if isinstance(triton_ops, ImportError):
        pytest.skip(f"no triton: {triton_ops}")
    monkeypatch.setattr(triton_ops, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    built = [True]
    monkeypatch.setattr(build, "load", lambda kind: torch_ops if built[0] else build.BuildError("no nvcc"))
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.backend("cuda") == "cuda" and kernels.implementation(torch.device("cuda")) is library.OPS
    assert kernels.implementation(torch.device("cuda", 0)) is library.OPS  # what a tensor on the GPU runs
    assert kernels.head_implementation(torch.device("cuda")) is library.triton_operators(triton_ops)
    assert kernels.backend("cpu") == "cpp"
    built[0] = False
    kernels._choose.cache_clear()  # another process, where nvcc is missing
    assert kernels.backend("cuda") == "triton"
    operators = kernels.implementation(torch.device("cuda"))  # the Triton kernels as operators, seen by a trace
    assert operators is library.triton_operators(triton_ops)
    for name in library.DECLARED:  # the same operators, in a namespace of their own
        schema = str(getattr(library.OPS, name).default._schema).replace("lowmem::", "lowmem_triton::")
        assert str(getattr(operators, name).default._schema) == schema
    built[0] = True
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    assert kernels.backend("cuda") == "triton"
    assert kernels.implementation(torch.device("cuda", 0)) is operators  # a choice for "cuda" is its tensors' choice
    monkeypatch.setenv(kernels.ENV_VAR, "cpp")
    assert kernels.backend("cuda") == "cuda"
    capability[0] = (7, 5)
    kernels._choose.cache_clear()  # a process sees one GPU: this one is another
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    with pytest.raises(RuntimeError, match="=triton was requested.*compute capability 7.5, Triton needs 8.0"):
        kernels.backend("cuda")
    with pytest.raises(RuntimeError, match="=triton was requested.*set TRITON_INTERPRET=1"):
        kernels.backend("cpu")
    with pytest.raises(RuntimeError, match="act_codes: .*CPU tensors only in Triton's interpreter"):
        triton_ops.act_codes(torch.ones(4), GELU_2BIT.thresholds)


def test_failed_build_falls_back_once_or_raises_when_forced(monkeypatch):
    monkeypatch.setattr(build, "load", lambda kind: build.BuildError("no C++ compiler"))
    kernels._warn_fallback.cache_clear()
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler.*pure-PyTorch"):
        assert kernels.backend("cpu") == "torch"
    assert kernels.implementation(torch.device("cpu")) is torch_ops  # no second warning: cached
    monkeypatch.setenv(kernels.ENV_VAR, "cpp")
    with pytest.raises(RuntimeError, match="LIGHTNING_LOWMEM_BACKEND=cpp.*no C\\+\\+ compiler"):
        kernels.backend("cpu")
    kernels._warn_fallback.cache_clear()


def test_no_compiler_or_sources_is_a_build_error(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "empty-cache"))  # no valid build to load instead
    monkeypatch.setenv("CXX", "no-such-compiler-lowmem")
    with pytest.raises(build.BuildError, match="no C\\+\\+ compiler"):
        build.build("cpu")
    monkeypatch.setattr(build, "CSRC", tmp_path / "missing")
    with pytest.raises(build.BuildError, match="sources are not installed"):
        build.build("cpu")


@pytest.fixture
def cached_copy(tmp_path, monkeypatch):
    """A cache root holding a copy of this machine's valid CPU build, made the current cache."""
    assert not isinstance(build.load("cpu"), build.BuildError)
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    shutil.copytree(build.load("cpu").parent, build.build_dir("cpu"))
    return build.build_dir("cpu")


def test_a_build_is_moved_into_place_whole_with_its_checksum():
    directory = build.load("cpu").parent
    library = directory / build.library_name("cpu")
    assert (directory / build.CHECKSUM).read_text() == build._checksum(library)
    assert not list(directory.parent.glob(f"{directory.name}.staging-*"))  # no staging directory left behind


def test_a_damaged_library_is_detected_before_loading_and_rebuilt(cached_copy, monkeypatch):
    library = cached_copy / build.library_name("cpu")
    library.write_bytes(library.read_bytes()[:4096])  # what a killed copy or a full disk leaves
    with pytest.raises(build.DamagedBuild, match="does not match its checksum"):
        build._valid_library(cached_copy, "cpu")
    rebuilt = []
    monkeypatch.setattr(build, "_compile_into", lambda directory, kind, verbose: rebuilt.append(directory) or library)
    with pytest.warns(RuntimeWarning, match="does not match its checksum; rebuilding"):
        build.build("cpu")
    assert rebuilt == [cached_copy]
    (cached_copy / build.CHECKSUM).unlink()
    with pytest.raises(build.DamagedBuild, match="no checksum"):
        build._valid_library(cached_copy, "cpu")


def test_a_valid_build_loads_without_compiler_or_write_access(cached_copy):
    """A read-only shared cache holding this version's build: loaded as it is, nothing compiled or written."""
    before = sorted(p.name for p in cached_copy.parent.iterdir())
    env = os.environ | {build.CACHE_ENV: str(cached_copy.parent), "CXX": "no-such-compiler-lowmem"}
    script = "from lightning_lowmem import kernels; print(kernels.backend('cpu'))"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "cpp", out.stderr
    assert sorted(p.name for p in cached_copy.parent.iterdir()) == before  # not even a lock file


def test_a_read_only_cache_without_a_valid_build_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "read-only"))
    monkeypatch.setattr(build, "_writable", lambda directory: False)
    with pytest.raises(build.BuildError, match=f"not writable.*set {build.CACHE_ENV}.*lightning_lowmem.kernels build"):
        build.build("cpu")


def hold_lock_in_child(directory) -> subprocess.Popen:
    """A process that takes the build lock of ``directory`` and keeps it until it is killed."""
    script = (
        "import sys, time; from pathlib import Path; from lightning_lowmem.kernels import build\n"
        f"with build.build_lock(Path({str(directory)!r})):\n    print('locked', flush=True); time.sleep(600)"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "locked"
    return child


def test_the_build_lock_is_exclusive_and_dies_with_its_holder(tmp_path):
    directory = tmp_path / "cpu-key"
    child = hold_lock_in_child(directory)
    lock = build.FileLock(directory.with_name(directory.name + ".lock"))
    with pytest.raises(build.Timeout):
        lock.acquire(timeout=0)  # held by a live process
    child.kill()  # as a killed build dies: no cleanup code runs
    child.wait()
    lock.acquire(timeout=60)  # the OS released it (a bounded wait, so a bug fails instead of hanging)
    lock.release()


def test_ninja_found_from_the_interpreter_environment(monkeypatch):
    if not any(shutil.which("ninja", path=str(d)) for d in build._ninja_dirs()):
        pytest.skip("no ninja installed next to this interpreter")
    monkeypatch.setenv("PATH", "/nonexistent")
    with build.ninja_on_path():
        assert shutil.which("ninja")
    assert os.environ["PATH"] == "/nonexistent"


def test_cli_prebuilds_and_reports():
    assert not isinstance(build.load("cpu"), build.BuildError)  # built (or cached) in-process: the CLI only loads
    out = subprocess.run(
        [sys.executable, "-m", "lightning_lowmem.kernels", "build"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    assert f"cpu: built {build.load('cpu')}" in out and "cpu tensors -> cpp" in out
