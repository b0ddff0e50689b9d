"""The activation registry: exact stock forwards, step derivatives, bits, and the generated tables."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_lowmem.approx.__main__ import render
from lightning_lowmem.registry import activations as activation_registry
from lightning_lowmem.registry import step_tables
from lightning_lowmem.registry.activations import (
    ACTIVATIONS,
    GELU_2BIT,
    SILU_2BIT,
    StepDerivative,
    check_bits,
    code_bits,
    get_activation,
)

# Written out independently of the registry: what each activation computes.
REFERENCE = {
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    "silu": lambda x: x / (1 + torch.exp(-x)),
    "quick_gelu": lambda x: x / (1 + torch.exp(-1.702 * x)),
    "mish": lambda x: x * torch.tanh(torch.log1p(torch.exp(x))),
}


def test_every_activation_is_registered_once_with_its_function():
    assert set(ACTIVATIONS) == set(REFERENCE)
    x = torch.linspace(-8, 8, 1601, dtype=torch.float64)
    for name, entry in ACTIVATIONS.items():
        torch.testing.assert_close(entry.stock(x), REFERENCE[name](x), rtol=1e-12, atol=1e-12, msg=name)


def test_the_stock_forward_is_the_torch_function_bit_for_bit():
    x = torch.randn(4096)
    assert torch.equal(ACTIVATIONS["gelu"].stock(x), F.gelu(x))
    assert torch.equal(ACTIVATIONS["silu"].stock(x), F.silu(x))
    assert torch.equal(ACTIVATIONS["mish"].stock(x), F.mish(x))


@pytest.mark.parametrize("name", list(REFERENCE))
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_step_derivatives_are_well_formed(name, bits):
    step = ACTIVATIONS[name].step_derivative(bits)
    assert len(step.thresholds) == 2**bits - 1 and len(step.levels) == 2**bits
    assert list(step.thresholds) == sorted(step.thresholds) and step.levels[0] == 0.0 and step.levels[-1] == 1.0


def test_paper_constants_at_two_bits_tables_elsewhere():
    assert ACTIVATIONS["gelu"].step_derivative(2) is GELU_2BIT is ACTIVATIONS["gelu_tanh"].step_derivative(2)
    assert ACTIVATIONS["silu"].step_derivative(2) is SILU_2BIT
    assert ACTIVATIONS["mish"].step_derivative(2) == StepDerivative(*step_tables.TABLES["mish"][2])
    assert ACTIVATIONS["gelu"].step_derivative(4) == StepDerivative(*step_tables.TABLES["gelu"][4])


@pytest.mark.parametrize("bad", [0, 5, 2.5, True, "2", None])
def test_bad_bits_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"owner: bits must be one of \(1, 2, 3, 4\)"):
        check_bits("owner", bad)


def test_code_bits_and_gated_choices():
    assert [code_bits(b) for b in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert activation_registry.GATED_ACTIVATIONS == ("gelu", "gelu_tanh", "silu")
    with pytest.raises(ValueError, match="GatedMLP: activation must be one of \\('gelu', 'gelu_tanh', 'silu'\\)"):
        get_activation("mish", "GatedMLP", gated=True)
    with pytest.raises(ValueError, match="activation must be one of"):
        get_activation("relu")
    with pytest.raises(ValueError, match=r"activation must be one of .*got \['gelu'\]"):
        get_activation(["gelu"])  # unhashable: refused by name too, not a TypeError from the lookup
    assert get_activation("silu", gated=True) is activation_registry.ACTIVATIONS["silu"]


def test_generator_reproduces_the_committed_tables_file():
    """`python -m lightning_lowmem.approx --write` owns step_tables.py's layout (ruff leaves it alone)."""
    tables = {n: {b: StepDerivative(*v) for b, v in per.items()} for n, per in step_tables.TABLES.items()}
    with open(step_tables.__file__) as committed:
        assert render(tables, step_tables.OBJECTIVES) == committed.read()
