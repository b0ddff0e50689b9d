"""k-bit step derivatives (1, 2, 3 stored as 4, 4 bits): layout, saved bytes, exact backward, all backends."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_lowmem import functional, kernels
from lightning_lowmem.kernels import torch_ops
from lightning_lowmem.nn import ReGELU2, ReSiLU2
from lightning_lowmem.registry.activations import ACTIVATIONS, GELU_2BIT, SILU_2BIT, code_bits
from lightning_lowmem.registry.step_tables import TABLES


def step_derivative(kind: str, bits: int = 2):
    return ACTIVATIONS[kind].step_derivative(bits)


BITS = (1, 2, 3, 4)
KINDS = ("gelu", "gelu_tanh", "silu")
# Per backend: odd tails, both sides of its block (C++: 4096-element staging; CUDA and Triton: 1024), many blocks.
SIZES = {
    "cpp": [0, 1, 3, 7, 9, 4095, 4097, 2 * 4096 + 5, 100_003],
    "cuda": [0, 1, 3, 7, 9, 1023, 1025, 100_003],
    "triton": [0, 1, 3, 7, 9, 1023, 1025, 2 * 1024 + 5],
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def with_thresholds(n: int, step, dtype) -> torch.Tensor:
    """Wide random values with the thresholds themselves (as rounded to dtype) at the front."""
    x = torch.randn(n, dtype=torch.float64) * 5
    t = torch.tensor(step.thresholds, dtype=torch.float64)
    k = min(n, t.numel())
    x[:k] = t[:k]
    return x.to(dtype)


def reference_codes(x: torch.Tensor, thresholds) -> torch.Tensor:
    xa = x.reshape(-1).to(torch_ops.accumulate_dtype(x.dtype))
    return sum((xa > t).long() for t in thresholds) if thresholds else torch.zeros_like(xa, dtype=torch.long)


@pytest.mark.parametrize("bits", BITS)
def test_layout_is_k_bits_per_code_low_bits_first(bits):
    step = step_derivative("gelu", bits)
    k = code_bits(bits)
    x = with_thresholds(37, step, torch.float32)
    packed = torch_ops.act_codes(x, step.thresholds)
    assert packed.numel() == math.ceil(37 * k / 8)
    codes = reference_codes(x, step.thresholds)
    per = 8 // k
    for i in range(37):
        assert (int(packed[i // per]) >> (k * (i % per))) & ((1 << k) - 1) == int(codes[i])
    assert torch.equal(torch_ops.unpack_codes(packed, 37, k), codes)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", BITS)
def test_compiled_matches_reference_for_each_k(kernel_backend, bits, kind, dtype):
    ext, step = kernel_backend.module, step_derivative(kind, bits)
    for n in SIZES[kernel_backend.name]:
        x = with_thresholds(n, step, dtype).to(kernel_backend.device)
        packed = ext.act_codes(x, step.thresholds)
        packed_ref = torch_ops.act_codes(x, step.thresholds)
        assert torch.equal(packed, packed_ref), n
        g = torch.randn(n, dtype=torch.float64).to(dtype=dtype, device=kernel_backend.device)
        assert torch.equal(ext.act_backward(g, packed, step.levels), torch_ops.act_backward(g, packed_ref, step.levels))


# Ascending with ties, one to fifteen thresholds: the compiled kernels may search a table (4 bits) where the
# reference counts, and must agree on ties, on the thresholds themselves, next to them, and on nan and inf.
TIED_TABLES = [(0.5,), (-1.0, -1.0), (-1.0, 0.0, 0.0), (-2.0, -1.0, -1.0, 0.0, 0.0, 0.0, 3.0)]
TIED_TABLES.append((-3.0, -1.0, -1.0, -1.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 4.0))


@pytest.mark.parametrize("thresholds", TIED_TABLES, ids=lambda t: f"{len(t)}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes_of_tied_thresholds_and_edge_values(kernel_backend, thresholds, dtype):
    t = torch.tensor(thresholds, dtype=torch.float32)
    edges = torch.cat([t, t.nextafter(torch.tensor(math.inf)), t.nextafter(torch.tensor(-math.inf))])
    edges = torch.cat([edges, torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e30, -1e30])])
    for n in (edges.numel(), 4099):  # the edges alone, then among random values over several blocks
        x = torch.cat([edges, torch.randn(n, dtype=torch.float64) * 3])[:n].to(dtype)
        got = kernel_backend.module.act_codes(x.to(kernel_backend.device), thresholds).cpu()
        assert torch.equal(got, torch_ops.act_codes(x, thresholds)), n


def test_compiled_rejects_bad_tables(kernel_backend):
    ext, x = kernel_backend.module, torch.randn(4, 33, device=kernel_backend.device)
    with pytest.raises(ValueError, match="thresholds"):
        ext.act_codes(x, tuple(range(16)))
    with pytest.raises(ValueError, match="levels"):
        ext.act_backward(x, torch.zeros(132, dtype=torch.uint8, device=x.device), (0.0,) * 17)
    with pytest.raises(ValueError, match="packed bytes"):
        ext.act_backward(x, torch.zeros(33, dtype=torch.uint8, device=x.device), (0.0,) * 16)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("op,kind", [(functional.regelu2, "gelu"), (functional.resilu2, "silu")])
def test_saved_bytes_and_exact_backward(op, kind, bits):
    """Saves ceil(numel*k/8) bytes; the gradient is grad * levels[sum(x > t)], exactly."""
    step = step_derivative(kind, bits)
    x = with_thresholds(8 * 197 + 3, step, torch.float32).view(1, -1).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = op(x, bits=bits)
    assert [(t.dtype, t.numel()) for t in saved] == [(torch.uint8, math.ceil(x.numel() * code_bits(bits) / 8))]
    assert torch.equal(y, F.gelu(x) if kind == "gelu" else F.silu(x))
    g = torch.randn_like(x)
    (grad,) = torch.autograd.grad(y, x, g)
    levels = torch.tensor(step.levels, dtype=torch.float32)
    expected = g * levels[reference_codes(x.detach(), step.thresholds)].view_as(g)
    assert torch.equal(grad, expected)


def test_default_is_the_papers_two_bit_constants():
    assert step_derivative("gelu") == GELU_2BIT and step_derivative("gelu_tanh", 2) == GELU_2BIT
    assert step_derivative("silu") == SILU_2BIT
    assert step_derivative("gelu", 4) == TABLES["gelu"][4]  # (thresholds, levels)


def test_modules_and_bad_bits():
    x = torch.randn(4, 33, requires_grad=True)
    for module in (ReGELU2(bits=4), ReGELU2("tanh", bits=1), ReSiLU2(bits=3)):
        module(x).sum().backward()
        assert f"{module.bits}-bit" in repr(module)
    for bad in (0, 5, 8):
        with pytest.raises(ValueError, match="bits"):
            ReGELU2(bits=bad)
    # the ops refuse by name what check_bits refuses: a bool (True == 1 as a dict key), a string, None
    for bad in (0, 5, 8, True, False, "2", None, 2.5):
        with pytest.raises(ValueError, match="regelu2.*bits"):
            functional.regelu2(x, bits=bad)
        with pytest.raises(ValueError, match="step_activation.*bits"):
            functional.step_activation(x, "silu", bits=bad)
    torch.testing.assert_close(  # a float of a supported width is that width, as check_bits says
        torch.autograd.grad(functional.resilu2(x, bits=2.0).sum(), x)[0],
        torch.autograd.grad(functional.resilu2(x, bits=2).sum(), x)[0],
        rtol=0,
        atol=0,
    )


def test_surgery_and_callback_take_bits():
    from lightning_lowmem import LowMemBP, apply_lowmem

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8), torch.nn.SiLU())
    apply_lowmem(model, bits=4, example_input=torch.randn(2, 8))
    assert model[1].bits == 4 and model[3].bits == 4
    assert LowMemBP(bits=1).options.bits == 1
    with pytest.raises(ValueError, match="bits"):
        apply_lowmem(torch.nn.Sequential(torch.nn.GELU()), bits=5)


def test_backend_in_use_is_compiled_here():
    assert kernels.backend("cpu") in ("cpp", "torch")
