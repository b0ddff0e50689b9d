"""SavedTensorMeter on cases whose answer is known by hand."""

from __future__ import annotations

import torch
from torch import nn

from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.nn import ReGELU2


def test_plain_linear_saves_its_input_only():
    linear = nn.Linear(16, 8)
    x = torch.randn(4, 16)  # no grad on the input: the weight's gradient needs x
    with SavedTensorMeter(linear) as meter:
        linear(x).sum().backward()
    assert meter.total_bytes == 4 * 16 * 4
    assert meter.peak_bytes == 4 * 16 * 4
    assert meter.live_bytes == 0


def test_frozen_linear_saves_no_input():
    linear = nn.Linear(16, 8).requires_grad_(False)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedTensorMeter(linear) as meter:
        linear(x)
    assert meter.total_bytes == 0


def test_a_tensor_saved_twice_counts_once():
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(32))
            self.w2 = nn.Parameter(torch.randn(32))

        def forward(self, x):
            shared = x.exp()
            return shared * self.w1 + shared * self.w2  # both products save `shared`

    model = TwoHeads()
    with SavedTensorMeter(model) as meter:
        model(torch.randn(10, 32))
    assert len(meter.records) == 1
    assert meter.total_bytes == 10 * 32 * 4


def test_parameters_and_their_views_are_excluded_even_without_a_model():
    weight = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(3, 8, requires_grad=True)
    with SavedTensorMeter() as meter:
        x @ weight.t()  # saves the view weight.t() (for x's grad) and x (for the weight's grad)
    assert meter.total_bytes == 3 * 8 * 4


def test_buffers_of_the_model_are_excluded():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.randn(8))

        def forward(self, x):
            return x * self.scale

    model = Scaled()
    with SavedTensorMeter(model) as meter:
        model(torch.randn(3, 8, requires_grad=True))
    assert meter.total_bytes == 0


def test_per_module_breakdown_and_peak():
    model = nn.Sequential(nn.Linear(16, 64), ReGELU2(), nn.Linear(64, 4))
    x = torch.randn(5, 16)
    with SavedTensorMeter(model) as meter:
        model(x).sum().backward()
    assert meter.by_module == {"2": 5 * 64 * 4, "0": 5 * 16 * 4, "1": 5 * 64 // 4}
    assert meter.total_bytes == sum(meter.by_module.values())
    assert meter.peak_bytes == meter.total_bytes
    assert meter.live_bytes == 0
    assert "total" in meter.table() and "2 " in meter.table()


def test_live_bytes_drop_as_the_graph_is_freed():
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    with SavedTensorMeter(model) as meter:
        first = model(torch.randn(4, 16)).sum()
        held = meter.live_bytes
        second = model(torch.randn(4, 16)).sum()
        assert meter.live_bytes == 2 * held
        first.backward()
        assert meter.live_bytes == held
    second.backward()
    assert meter.live_bytes == 0
    assert meter.peak_bytes == 2 * held


def test_meter_does_not_change_gradients():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 1))
    x = torch.randn(6, 8)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with SavedTensorMeter(model):
        model(x).sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))
