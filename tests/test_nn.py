"""Modules: same function as the stock module, from_module, readable repr, refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.nn import LowMemActivation, LowMemLinear, MSLayerNorm, MSRMSNorm, ReGELU2, ReSiLU2
from lightning_lowmem.nn.norm import is_norm_output


@pytest.mark.parametrize("stock", [nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU(), nn.SiLU(inplace=True)])
def test_activation_from_module_computes_the_stock_forward(stock):
    ours = (ReSiLU2 if isinstance(stock, nn.SiLU) else ReGELU2).from_module(stock)
    x = torch.randn(5, 7, requires_grad=True)
    assert torch.equal(ours(x), stock(x.detach().clone()))


@pytest.mark.parametrize(
    "stock, cls",
    [
        (nn.LayerNorm(12, eps=1e-6, elementwise_affine=False), MSLayerNorm),
        (nn.RMSNorm(12, eps=1e-6, elementwise_affine=False), MSRMSNorm),
    ],
)
def test_norm_from_module_computes_the_stock_forward(stock, cls):
    ours = cls.from_module(stock)
    assert ours.eps == 1e-6 and ours.normalized_shape == (12,)
    x = torch.randn(3, 4, 12, requires_grad=True)
    torch.testing.assert_close(ours(x), stock(x))
    assert list(ours.parameters()) == []


def test_rms_norm_default_eps_follows_the_input_dtype():
    stock = nn.RMSNorm(8, elementwise_affine=False)  # eps=None: finfo(dtype).eps
    ours = MSRMSNorm.from_module(stock)
    x = torch.randn(2, 8, dtype=torch.float64) * 1e-8
    torch.testing.assert_close(ours(x), stock(x))


@pytest.mark.parametrize("cls", [ReGELU2, ReSiLU2, MSLayerNorm, MSRMSNorm])
def test_from_module_rejects_other_modules(cls):
    with pytest.raises(TypeError, match=f"{cls.__name__}.from_module expects"):
        cls.from_module(nn.ReLU())


def test_extra_repr_is_readable():
    assert repr(ReGELU2("tanh")) == "ReGELU2(approximate='tanh', backward=2-bit)"
    assert repr(ReSiLU2()) == "ReSiLU2(backward=2-bit)"
    assert (
        repr(LowMemActivation("mish", bits=3))
        == "LowMemActivation(activation='mish', backward=3-bit (stored in 4 bits))"
    )
    assert repr(MSLayerNorm(768)) == "MSLayerNorm((768,), eps=1e-05, saves=normalized output+rstd)"
    assert repr(MSRMSNorm((4, 8), eps=None)) == "MSRMSNorm((4, 8), eps=None, saves=normalized output+rstd)"


def test_regelu2_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate must be"):
        ReGELU2("fast")


@pytest.mark.parametrize("stock, cls", [(nn.LayerNorm(12), MSLayerNorm), (nn.RMSNorm(12), MSRMSNorm)])
def test_hand_built_norm_and_consumers_equal_the_stock_pair_and_share_one_tensor(stock, cls):
    """What apply_lowmem installs, built by hand: the norm keeps its Parameters and returns the stock
    output (also to a residual reader); the consumer linears save the norm's normalized output."""
    with torch.no_grad():
        stock.weight.normal_()
        if getattr(stock, "bias", None) is not None:
            stock.bias.normal_()
    q, v = nn.Linear(12, 6), nn.Linear(12, 12)
    norm = cls.from_module(stock)
    q2, v2 = LowMemLinear.from_linear(q, norm=norm), LowMemLinear.from_linear(v, norm=norm)
    assert norm.weight is stock.weight
    x = torch.randn(3, 5, 12, requires_grad=True)
    h = stock(x)
    expected = (q(h) * v(h)[..., :6]).sum() + (h + x).square().sum()  # a residual reader too
    with SavedTensorMeter(norm) as meter:
        y = norm(x)
        out = (q2(y) * v2(y)[..., :6]).sum() + (y + x).square().sum()
    torch.testing.assert_close(y, h)
    torch.testing.assert_close(out, expected)
    # the norm's z (which q2 and v2 save too) and the square's input: no copy of y for the consumers
    assert [r.module for r in meter.records if r.shape == (3, 5, 12)] == ["<root>", "<outside>"]
    params = [x, stock.weight, q.weight, v.weight]
    torch.testing.assert_close(torch.autograd.grad(out, params), torch.autograd.grad(expected, params))


@pytest.mark.parametrize("stock, cls", [(nn.LayerNorm(12), MSLayerNorm), (nn.RMSNorm(12), MSRMSNorm)])
def test_a_frozen_norm_and_its_consumers_share_its_output(stock, cls):
    """A frozen affine (LoRA's norms): the norm saves its output itself, untagged, and the consumer linears
    save it as it is: one tensor for the three, and the stock gradients."""
    with torch.no_grad():  # as pretrained norms: |bias| < |weight| (else z is saved, see test_ops_norm)
        stock.weight.uniform_(1, 2)
        if getattr(stock, "bias", None) is not None:
            stock.bias.uniform_(-0.5, 0.5)
    stock.requires_grad_(False)
    q, v = nn.Linear(12, 6), nn.Linear(12, 12)
    norm = cls.from_module(stock)
    q2, v2 = LowMemLinear.from_linear(q, norm=norm), LowMemLinear.from_linear(v, norm=norm)
    x = torch.randn(3, 5, 12, requires_grad=True)
    h = stock(x)
    expected = (q(h) * v(h)[..., :6]).sum()
    with SavedTensorMeter(norm) as meter:
        y = norm(x)
        out = (q2(y) * v2(y)[..., :6]).sum()
    assert not is_norm_output(y)
    torch.testing.assert_close(out, expected)
    assert [r.module for r in meter.records if r.shape == (3, 5, 12)] == ["<root>"]
    params = [x, q.weight, v.weight]
    torch.testing.assert_close(torch.autograd.grad(out, params), torch.autograd.grad(expected, params))


def test_a_consumer_called_on_another_input_is_an_ordinary_linear():
    norm = MSLayerNorm.from_module(nn.LayerNorm(8))
    linear = nn.Linear(8, 4)
    consumer = LowMemLinear.from_linear(linear, norm=norm)
    x = torch.randn(2, 8)
    norm(x)
    torch.testing.assert_close(consumer(x), linear(x))
    torch.testing.assert_close(consumer(norm(x) * 2), linear(nn.functional.layer_norm(x, (8,)) * 2))


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu", "quick_gelu", "mish"])
def test_create_picks_the_public_class(name):
    module = LowMemActivation.create(name, bits=1)
    expected = {"gelu": ReGELU2, "gelu_tanh": ReGELU2, "silu": ReSiLU2}.get(name, LowMemActivation)
    assert type(module) is expected and module.activation == name and module.bits == 1
