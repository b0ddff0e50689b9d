"""ReGELU2 / ReSiLU2: exact forward, step-derivative backward, 2-bit saved state, clear errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_lowmem.functional import regelu2, resilu2

# The paper's appendix-E constants, written out independently of lightning_lowmem.registry.activations.
PAPER = {
    "gelu": (
        (-0.04922261145617846, 1.0979632065417297),
        (-3.1858810036855245, -0.001178821281161997, 3.190832613414926),
    ),
    "silu": (
        (-0.04060357190528599, 1.080925428529668),
        (-6.3050461001646445, -0.0008684942046214787, 6.325815242089708),
    ),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(1,), (3,), (5, 7), (2, 3, 5), (4, 1, 3, 9), (8, 197, 30), (0,), (2, 0, 5)]
OPS = {
    "gelu": (lambda x: regelu2(x), lambda x: F.gelu(x)),
    "gelu_tanh": (lambda x: regelu2(x, approximate="tanh"), lambda x: F.gelu(x, approximate="tanh")),
    "silu": (lambda x: resilu2(x), F.silu),
}


def step_derivative_reference(x: torch.Tensor, family: str) -> torch.Tensor:
    """d(x) = a1[x>c1] + a2[x>c2] + (1-a1-a2)[x>c3], thresholds in the compare precision."""
    (a1, a2), cs = PAPER[family]
    weights = (a1, a2, 1.0 - a1 - a2)
    compare = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(compare)
    d = torch.zeros_like(x, dtype=torch.float64)
    for a, c in zip(weights, cs):
        d += a * (xc > torch.tensor(c, dtype=compare)).double()
    return d


def wide_input(shape, dtype) -> torch.Tensor:
    """Values spread over all four segments, plus the thresholds themselves when room allows."""
    x = torch.randn(shape, dtype=torch.float64) * 4
    flat = x.view(-1)
    specials = [c for _, cs in PAPER.values() for c in cs]
    flat[: min(len(specials), flat.numel())] = torch.tensor(specials[: flat.numel()], dtype=torch.float64)
    return x.to(dtype)


def _family(kind: str) -> str:
    return "silu" if kind == "silu" else "gelu"


@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_is_bitwise_stock(kind, dtype, shape):
    ours, stock = OPS[kind]
    x = wide_input(shape, dtype).requires_grad_()
    assert torch.equal(ours(x), stock(x.detach()))


@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_is_grad_times_step_derivative(kind, dtype, shape):
    ours, _ = OPS[kind]
    x = wide_input(shape, dtype).requires_grad_()
    grad = torch.randn(shape, dtype=dtype)
    ours(x).backward(grad)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    derivative = step_derivative_reference(x.detach(), _family(kind)).to(compute)
    expected = (grad.to(compute) * derivative).to(dtype)
    if dtype == torch.float64:  # 1 - a1 - a2 is not exactly representable: allow an ulp
        torch.testing.assert_close(x.grad, expected, rtol=1e-15, atol=0)
    else:
        assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [0, 1, 2, 3, 4, 5, 7, 8, 9, 1023, 4097])
def test_only_a_packed_uint8_buffer_is_saved(kind, dtype, numel, recorder):
    ours, _ = OPS[kind]
    x = torch.randn(numel, dtype=dtype, requires_grad=True)
    with recorder() as rec:
        ours(x)
    assert len(rec.saved) == 1
    (packed,) = rec.saved
    assert packed.dtype == torch.uint8
    assert packed.numel() == math.ceil(numel / 4)
    assert packed.untyped_storage().nbytes() == math.ceil(numel / 4)


def test_non_contiguous_input_matches_contiguous():
    base = wide_input((6, 10, 8), torch.float32)
    x = base.transpose(0, 2).requires_grad_()  # strided view of a leaf
    x = x.detach().requires_grad_()
    assert not x.is_contiguous()
    grad = torch.randn(x.shape).transpose(1, 2).contiguous().transpose(1, 2)
    regelu2(x).backward(grad)
    xc = x.detach().contiguous().requires_grad_()
    y = regelu2(xc)
    y.backward(grad.contiguous())
    assert torch.equal(regelu2(x), F.gelu(x.detach()))
    assert torch.equal(x.grad, xc.grad)


def test_under_autocast_follows_stock_dtype():
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = regelu2(x)
        stock = F.gelu(x.detach())
    assert y.dtype == stock.dtype
    assert torch.equal(y, stock)
    y.sum().backward()
    assert x.grad.dtype == torch.float32


def test_no_grad_saves_nothing(recorder):
    x = torch.randn(10, 10, requires_grad=True)
    with recorder() as rec, torch.no_grad():
        y = resilu2(x)
    assert rec.saved == []
    assert torch.equal(y, F.silu(x.detach()))
    with recorder() as rec:
        resilu2(x.detach())  # no grad required: nothing recorded either
    assert rec.saved == []


def test_retained_graph_gives_the_same_gradient_twice():
    x = torch.randn(33, requires_grad=True)
    y = regelu2(x)
    (first,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    (second,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(first, second)


@pytest.mark.parametrize("op", [regelu2, resilu2])
def test_second_backward_through_freed_graph_raises(op):
    x = torch.randn(9, requires_grad=True)
    y = op(x).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="second time"):
        y.backward()


@pytest.mark.parametrize("op, name", [(regelu2, "regelu2"), (resilu2, "resilu2")])
def test_double_backward_raises(op, name):
    x = torch.randn(9, requires_grad=True)
    with pytest.raises(RuntimeError, match=f"{name} does not support double backward"):
        torch.autograd.grad(op(x).sum(), x, create_graph=True)


@pytest.mark.parametrize("op", [regelu2, resilu2])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_unsupported_dtype_raises(op, dtype):
    with pytest.raises(TypeError, match="unsupported dtype"):
        op(torch.zeros(4, dtype=dtype))


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        regelu2([1.0, 2.0])
    with pytest.raises(ValueError, match="approximate must be"):
        regelu2(torch.zeros(3), approximate="sigmoid")
