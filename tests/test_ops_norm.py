"""MS-LayerNorm / MS-RMSNorm: stock-equivalent math, exactly (output, rstd) saved, real sharing."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_lowmem import kernels
from lightning_lowmem.functional import ms_layer_norm, ms_rms_norm
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.ops.autocast import autocast_dtype
from lightning_lowmem.ops.norm import memory_sharing_norm, writes_output_alone

NORMS = {
    "layer": (ms_layer_norm, lambda x, shape, eps: F.layer_norm(x, shape, eps=eps)),
    "rms": (ms_rms_norm, lambda x, shape, eps: F.rms_norm(x, shape, eps=eps)),
}
# with their affine: the stock functions' own weight / bias arguments
AFFINE_NORMS = {
    "layer": (
        lambda x, shape, w, b: ms_layer_norm(x, shape, 1e-5, weight=w, bias=b),
        lambda x, shape, w, b: F.layer_norm(x, shape, w, b, eps=1e-5),
    ),
    "rms": (
        lambda x, shape, w, b: ms_rms_norm(x, shape, 1e-5, weight=w),
        lambda x, shape, w, b: F.rms_norm(x, shape, w, eps=1e-5),
    ),
}
CASES = [((3, 8), (8,)), ((2, 5, 16), (16,)), ((2, 3, 4, 6), (4, 6)), ((7, 33), (33,)), ((1, 1), (1,))]
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("shape, normalized", CASES)
def test_gradcheck_fp64(kind, shape, normalized):
    ours, _ = NORMS[kind]
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ours(t, normalized, 1e-5), (x,))


@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("shape, normalized", CASES)
def test_gradcheck_fp64_with_affine(kind, shape, normalized):
    ours, _ = AFFINE_NORMS[kind]
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    w, b = (torch.randn(normalized, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda *t: ours(*t[:1], normalized, *t[1:]), (x, w, b))


@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("input_grad", [True, False], ids=["input_grad", "frozen_input"])
def test_affine_gradients_match_stock(kind, dtype, input_grad):
    """One kernel pass gives the input, weight and bias gradients; an input that needs no gradient keeps no
    rstd (the affine's gradients need only the saved output)."""
    ours, stock = AFFINE_NORMS[kind]
    x = (torch.randn(4, 5, 48) * 3 + 1).to(dtype).requires_grad_(input_grad)
    params = [torch.nn.Parameter(torch.randn(48)), torch.nn.Parameter(torch.randn(48))]  # the meter skips them
    grad = torch.randn(4, 5, 48).to(dtype)
    with SavedTensorMeter() as meter:
        y = ours(x, (48,), *params)
    want_bytes = y.numel() * y.element_size() + (20 * 4 if input_grad else 0)
    assert meter.total_bytes == want_bytes and y.dtype == dtype
    inputs = [x, *params] if input_grad else params
    got = torch.autograd.grad(y, inputs, grad, allow_unused=True)
    expected_y = stock(x.float(), (48,), *params).to(dtype)
    want = torch.autograd.grad(expected_y, inputs, grad, allow_unused=True)
    torch.testing.assert_close(y, expected_y, **TOLERANCE[dtype])
    for a, b in zip(got, want):
        if b is None:  # RMSNorm has no bias
            assert a is None
        else:
            torch.testing.assert_close(a, b, **TOLERANCE[dtype])


@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "autocast"])
def test_frozen_affine_saves_its_output(kind, dtype, recorder):
    """An affine that needs no gradient (LoRA's norms): the norm saves its output y itself (by pointer: the
    tensor its readers save), rstd, and z exactly at the columns y cannot give back (weight 0, |bias| >
    |weight|); the input gradient is stock's, those columns included (without them a zero weight gives NaN)."""
    ours, stock = AFFINE_NORMS[kind]
    in_dtype = torch.float32 if dtype == "autocast" else dtype
    x = (torch.randn(4, 5, 64) * 3 + 1).to(in_dtype).requires_grad_()
    weight, bias = torch.rand(64) + 1, torch.rand(64) - 0.5
    weight[0] = 0.0
    bias[1] = weight[1] + 1
    columns = [0, 1] if kind == "layer" else [0]  # RMSNorm has no bias; at most 64 / 32 columns
    grad = torch.randn(4, 5, 64)
    with recorder() as rec, torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast"):
        y = ours(x, (64,), weight, bias)
    out_dtype = torch.bfloat16 if dtype == "autocast" else dtype
    saved_y, rstd, saved_columns, exact = rec.saved[0], rec.saved[1], rec.saved[-2], rec.saved[-1]
    assert saved_y.data_ptr() == y.data_ptr() and y.dtype == out_dtype and rstd.shape == (20,)
    assert saved_columns.tolist() == columns and exact.shape == (20, len(columns)) and exact.dtype == out_dtype
    with SavedTensorMeter() as meter:
        y = ours(x, (64,), weight, bias)
    parameters = 64 * 4 * (2 if kind == "layer" else 1)  # plain tensors here, counted
    exact_bytes = len(columns) * (8 + 20 * y.element_size())  # the indices, and z there for the 20 rows
    assert meter.total_bytes == y.numel() * y.element_size() + 20 * 4 + exact_bytes + parameters
    (got,) = torch.autograd.grad(y, x, grad.to(y.dtype))
    xs = x.detach().float().requires_grad_()
    (want,) = torch.autograd.grad(stock(xs, (64,), weight, bias), xs, grad)
    assert got.dtype == in_dtype and got.isfinite().all()
    torch.testing.assert_close(got.float(), want, **TOLERANCE[out_dtype])


class OperatorNames(TorchDispatchMode):
    """The names of the operators called under it (``aten._to_copy``, ``lowmem.norm_output_forward``, ...)."""

    def __enter__(self):
        self.names = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["cpp", "python"])
def test_frozen_bfloat16_affine_reaches_the_kernels_uncast(path, monkeypatch):
    """A bfloat16 model's frozen norm: its weight and bias go to the kernels as they are, in the training forward,
    its backward and the eval forward (a cast of each before every call cost 3-4% of the norm's time), and y and the
    input gradient are those of the affine widened to fp32 first, bit for bit. Both autograd paths (C++, Python)."""
    if kernels.backend("cpu") != "cpp":
        pytest.skip("the CPU extension is not built here")
    if path == "python":
        monkeypatch.setattr(kernels, "autograd_in_cpp", lambda x: False)
    x = (torch.randn(6, 96) * 3 + 1).bfloat16()
    weight, bias = (torch.rand(96) + 1).bfloat16(), (torch.rand(96) - 0.5).bfloat16()
    weight[0] = 0.0  # a column saved exactly
    grad = torch.randn(6, 96).bfloat16()

    def step(weight, bias):
        leaf = x.clone().requires_grad_()
        with OperatorNames() as ops:
            y = ms_layer_norm(leaf, (96,), weight=weight, bias=bias)
            (grad_input,) = torch.autograd.grad(y, leaf, grad)
            with torch.no_grad():
                evaluated = ms_layer_norm(x, (96,), weight=weight, bias=bias)
        return (y, grad_input, evaluated), ops.names

    got, names = step(weight, bias)
    assert "aten._to_copy" not in names and names.count("lowmem.norm_output_forward") == 2
    assert "lowmem.norm_output_backward" in names
    want, _ = step(weight.float(), bias.float())
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("path", ["cpp", "python"])
@pytest.mark.parametrize("frozen", [True, False])
def test_gemma_offset_is_added_in_fp32_as_hugging_face_adds_it(path, frozen, monkeypatch):
    """Gemma's RMSNorm scales by ``1 + weight.float()``: a bfloat16 weight near 0 added to 1 in bfloat16 kept 8
    bits of itself, and 25-36% of the norm's outputs differed from Hugging Face's. Where the norm saves its output
    (frozen, on the CPU's side) that output is Hugging Face's bit for bit; where it saves ``z`` (trainable, or a
    GPU's side) ``y`` is the affine of the rounded ``z`` it shares, ``(1 + w) z``, with ``1 + w`` in fp32. Both
    autograd paths (C++, Python)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    if path == "python":
        monkeypatch.setattr(kernels, "autograd_in_cpp", lambda x: False)
    stock = GemmaRMSNorm(256, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        stock.weight.normal_(0, 0.3)  # pretrained Gemma norms hold weights around 0
    stock.weight.requires_grad_(not frozen)
    x = torch.randn(4, 16, 256, dtype=torch.bfloat16, requires_grad=True)
    y, z = memory_sharing_norm(x, 256, 1e-6, False, stock.weight, None, weight_offset=1.0)
    assert (z is None) == (frozen and writes_output_alone(x))
    if z is None:
        assert torch.equal(y, stock(x))
    else:
        scale = 1 + stock.weight.detach().float()
        assert torch.equal(y, (z.float() * scale).bfloat16())
        assert not torch.equal(y, (z.float() * (1 + stock.weight.detach())).bfloat16())  # the bfloat16 sum differs


def test_frozen_affine_with_many_columns_y_cannot_give_back_saves_z(recorder):
    """More than 1/32 of the columns to save exactly: the norm saves z, as with a trainable affine."""
    x = torch.randn(4, 64, requires_grad=True)
    weight = torch.ones(64)
    weight[:3] = 0.0
    with recorder() as rec:
        y, z = memory_sharing_norm(x, 64, 1e-5, True, weight, torch.zeros(64))
    assert z is not None and rec.saved[0].data_ptr() == z.data_ptr() != y.data_ptr()
    weight[2] = 1.0  # two columns: y
    with recorder() as rec:
        y, z = memory_sharing_norm(x, 64, 1e-5, True, weight, torch.zeros(64))
    assert z is None and rec.saved[0].data_ptr() == y.data_ptr() and rec.saved[-1].shape == (4, 2)


def test_frozen_affine_output_changed_in_place_is_refused_at_backward():
    """The norm saved its output: changed in place before backward, autograd says so (stock saves its input and
    would not notice; the surgery leaves a norm whose output is changed in place alone)."""
    x = torch.randn(4, 16, requires_grad=True)
    y = ms_layer_norm(x, 16, weight=torch.ones(16), bias=torch.zeros(16))
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_parameter_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="ms_layer_norm: weight of shape \\[7\\] does not match"):
        ms_layer_norm(torch.randn(3, 8), 8, weight=torch.ones(7))


@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, normalized", CASES)
def test_forward_and_backward_match_stock(kind, dtype, shape, normalized):
    ours, stock = NORMS[kind]
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    grad = torch.randn(shape).to(dtype)
    xa = x.clone().requires_grad_()
    xb = x.clone().requires_grad_()
    ya, yb = ours(xa, normalized, 1e-5), stock(xb, normalized, 1e-5)
    assert ya.dtype == yb.dtype == dtype
    torch.testing.assert_close(ya, yb, **TOLERANCE[dtype])
    ya.backward(grad)
    yb.backward(grad)
    torch.testing.assert_close(xa.grad, xb.grad, **TOLERANCE[dtype])


@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape, normalized", CASES)
def test_saves_exactly_its_output_and_rstd(kind, dtype, shape, normalized, recorder):
    ours, _ = NORMS[kind]
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    with recorder() as rec:
        y = ours(x, normalized, 1e-5)
    output, rstd = rec.saved
    assert output.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    rows = math.prod(shape) // math.prod(normalized)
    assert rstd.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert rstd.numel() == rows
    with SavedTensorMeter() as meter:
        y = ours(x, normalized, 1e-5)
    assert meter.total_bytes == y.numel() * y.element_size() + rows * rstd.element_size()


@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("autocast", [False, True])
def test_storage_is_shared_with_the_following_linear(kind, autocast, recorder):
    ours, _ = NORMS[kind]
    linear = torch.nn.Linear(64, 32)
    x = torch.randn(4, 10, 64, requires_grad=True)
    with recorder() as rec, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        z = ours(x, 64, 1e-5)
        out = linear(z)
    assert z.dtype == (torch.bfloat16 if autocast else torch.float32)
    norm_output = rec.saved[0]
    linear_inputs = [t for t in rec.saved[2:] if t.shape == (40, 64) or t.shape == (4, 10, 64)]
    assert linear_inputs, "the linear saved no input"
    assert {t.untyped_storage().data_ptr() for t in linear_inputs} == {norm_output.untyped_storage().data_ptr()}
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32


def test_meter_counts_the_shared_pair_once():
    linear = torch.nn.Linear(64, 32)
    x = torch.randn(4, 10, 64, requires_grad=True)
    with SavedTensorMeter(linear) as meter:
        linear(ms_layer_norm(x, 64))
    assert meter.total_bytes == 40 * 64 * 4 + 40 * 4


def test_output_dtype_is_input_dtype_without_autocast_and_autocast_dtype_with_it():
    x = torch.randn(3, 8, requires_grad=True)
    assert ms_rms_norm(x, 8).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ms_rms_norm(x, 8).dtype == torch.bfloat16
        assert ms_rms_norm(x.double(), 8).dtype == torch.float64
    y = ms_layer_norm(x.bfloat16(), 8)
    assert y.dtype == torch.bfloat16


def test_autocast_dtype_is_none_when_off_and_for_device_types_autocast_does_not_know():
    cpu, meta = torch.empty(1), torch.empty(1, device="meta")
    assert autocast_dtype(cpu) is None and autocast_dtype(meta) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype(cpu) == torch.bfloat16 and autocast_dtype(meta) is None


def test_non_contiguous_input():
    base = torch.randn(16, 6, 5)
    x = base.transpose(0, 1).detach().requires_grad_()  # (6, 16, 5): rows are strided
    assert not x.is_contiguous()
    xs = x.detach().clone().requires_grad_()
    grad = torch.randn(6, 16, 5)
    ms_layer_norm(x, 5).backward(grad)
    F.layer_norm(xs, (5,)).backward(grad)
    torch.testing.assert_close(x.grad, xs.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", NORMS)
def test_empty_input(kind):
    ours, _ = NORMS[kind]
    x = torch.randn(0, 4, 8, requires_grad=True)
    y = ours(x, 8, 1e-5)
    assert y.shape == (0, 4, 8)
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_no_grad_saves_nothing(recorder):
    x = torch.randn(4, 8, requires_grad=True)
    with recorder() as rec, torch.no_grad():
        y = ms_layer_norm(x, 8)
    assert rec.saved == []
    torch.testing.assert_close(y, F.layer_norm(x.detach(), (8,)))


@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["no_grad", "nothing_needs_grad"])
def test_affine_norm_that_saves_nothing_writes_its_output_alone(kind, dtype, mode):
    """An eval forward (or one where nothing needs a gradient) saves nothing, so nothing needs z: on CPU the
    norm writes y alone, as stock's, rounded once from the unrounded z."""
    _, stock = AFFINE_NORMS[kind]
    x = (torch.randn(6, 5, 64) * 3 + 1).to(dtype)
    weight, bias = (1 + torch.randn(64) / 4).to(dtype), (torch.randn(64) / 10).to(dtype)
    with torch.no_grad() if mode == "no_grad" else contextlib.nullcontext():
        y, z = memory_sharing_norm(x, 64, 1e-5, kind == "layer", weight, bias if kind == "layer" else None)
    assert z is None and y.dtype == dtype
    want = stock(x.float(), (64,), weight.float(), bias.float())
    torch.testing.assert_close(y, want.to(dtype), **TOLERANCE[dtype])


@pytest.mark.parametrize("kind", NORMS)
def test_bad_input_raises(kind):
    ours, _ = NORMS[kind]
    name = "ms_layer_norm" if kind == "layer" else "ms_rms_norm"
    with pytest.raises(ValueError, match=f"{name}: normalized_shape \\[7\\] must match"):
        ours(torch.randn(3, 8), 7, 1e-5)
    with pytest.raises(ValueError, match="must match"):
        ours(torch.randn(8), (2, 8), 1e-5)
    with pytest.raises(ValueError, match="eps must be positive"):
        ours(torch.randn(3, 8), 8, 0.0)
    with pytest.raises(TypeError, match="unsupported dtype"):
        ours(torch.ones(3, 8, dtype=torch.int64), 8, 1e-5)
    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match=f"{name} does not support double backward"):
        torch.autograd.grad(ours(x, 8, 1e-5).square().sum(), x, create_graph=True)
    y = ours(x, 8, 1e-5).square().sum()
    y.backward()
    with pytest.raises(RuntimeError, match="second time"):
        y.backward()
