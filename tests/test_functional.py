"""Activations called as functions inside a forward (``surgery/families/functional.py``): every form the rewrite knows,
gated MLPs found by data flow whatever their children are called, a hand-written torchtitan-style LLaMA saving
what Hugging Face's LLaMA saves, what is left alone and why, and torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import zoo
from lightning_lowmem import apply_lowmem
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.nn.rewritten import rewritten_forward_of

WIDTH, HIDDEN = 16, 24


class Forms(nn.Module):
    """One MLP form, written with functions (``form`` picks it)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.a, self.b = nn.Linear(WIDTH, HIDDEN), nn.Linear(WIDTH, HIDDEN)
        self.packed = nn.Linear(WIDTH, 2 * HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.scale = nn.Parameter(torch.rand(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "silu * up":
            return self.down(F.silu(self.a(x)) * self.b(x))
        if self.form == "up * silu":
            return self.down(self.b(x) * F.silu(self.a(x)))
        if self.form == "gelu tanh * up":
            return self.down(F.gelu(self.a(x), approximate="tanh") * self.b(x))
        if self.form == "x * sigmoid(x) * up":
            h = self.a(x)
            return self.down(h * torch.sigmoid(h) * self.b(x))
        if self.form == "packed":
            gate, up = self.packed(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        if self.form == "gelu":
            return self.down(F.gelu(self.a(x)))
        if self.form == "silu * broadcast":
            return self.down(F.silu(self.a(x)) * self.scale)
        raise AssertionError(self.form)


def wrapped(form: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Forms(form))  # the surgery rewrites submodules' forwards, not the model's own


GATED = ["silu * up", "up * silu", "gelu tanh * up", "x * sigmoid(x) * up", "packed"]


def saved(model: nn.Module, x: torch.Tensor) -> int:
    with SavedTensorMeter(model) as meter:
        model(x)
    return meter.total_bytes


@pytest.mark.parametrize("form", [*GATED, "gelu", "silu * broadcast"])
def test_every_form_is_rewritten_and_computes_the_stock_outputs(form):
    stock = wrapped(form)
    model, x = copy.deepcopy(stock), torch.randn(3, 5, WIDTH)
    report = apply_lowmem(model, example_input=x)
    entry = next(e for e in report.entries if e.name == "0")
    assert (entry.kind, entry.status, entry.was) == (
        "gated MLP" if form in GATED else "activation",
        "converted",
        "Forms",
    )
    assert "test_functional.py:" in entry.detail  # the call site
    assert rewritten_forward_of(model[0]) is not None and type(model[0]) is Forms  # its class and children kept
    exact = 0.0 if "sigmoid" not in form else 1e-6  # F.silu rounds once where x * sigmoid(x) rounds twice
    torch.testing.assert_close(model.train()(x), stock.train()(x), rtol=exact, atol=exact)
    assert saved(model, x) < saved(stock, x)


@pytest.mark.parametrize("form", GATED)
def test_a_gated_product_found_by_data_flow_is_exact(form):
    """The fused product is exact: every gradient is the stock one (the activations alone would be the 2-bit
    approximation)."""
    stock = wrapped(form)
    model, x = copy.deepcopy(stock), torch.randn(3, 5, WIDTH)
    apply_lowmem(model, example_input=x, activation=False)
    for m in (model, stock):
        m(x).square().sum().backward()
    for (name, ours), theirs in zip(model.named_parameters(), stock.parameters()):
        if theirs.grad is not None:
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_options_choose_what_is_rewritten():
    x = torch.randn(3, 5, WIDTH)
    model = wrapped("silu * up")
    report = apply_lowmem(model, example_input=x, gated=False)
    assert "SiLU with a 2-bit backward" in report.entries[0].detail  # not fused: the activation alone
    model = wrapped("gelu")
    apply_lowmem(model, example_input=x, activation=False)
    assert rewritten_forward_of(model[0]) is None


class ReadsTraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.dropout(F.gelu(self.fc(x)), 0.1, self.training))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.fc(x)) if x.sum() > 0 else self.fc(x)


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (ReadsTraining(), "its forward reads self.training (tracing fixes it)"),
        (DataDependent(), "its forward cannot be traced (TraceError)"),
    ],
)
def test_forwards_the_rewrite_cannot_hold_are_left_alone_with_the_reason(module, reason):
    model, x = nn.Sequential(module), torch.ones(3, WIDTH)
    report = apply_lowmem(model, example_input=x)
    entry = next(e for e in report.entries if e.name == "0")
    assert entry.status == "left alone" and reason in entry.detail
    assert rewritten_forward_of(module) is None


def test_a_second_run_changes_nothing():
    model, x = wrapped("silu * up"), torch.randn(3, 5, WIDTH)
    apply_lowmem(model, example_input=x)
    forward = model[0].forward
    again = apply_lowmem(model, example_input=x)
    assert not again.converted and model[0].forward is forward
    assert [e.status for e in again.entries if e.name == "0"] == ["already converted"]


def test_a_torchtitan_llama_saves_what_hugging_face_llama_saves():
    """A hand-written LLaMA (functional SiLU in ``w2(F.silu(w1(x)) * w3(x))``, ``nn.RMSNorm``) converts as
    ``LlamaForCausalLM`` does: the same conversions, the same reduction (within a point), exact gradients."""
    x = zoo.tokens()
    torch.manual_seed(0)
    stock = zoo.TitanTransformer()
    model = copy.deepcopy(stock)
    ours = apply_lowmem(model, example_input=x, activation=False)
    theirs = apply_lowmem(zoo.llama(num_key_value_heads=4), example_input={"input_ids": x, "use_cache": False})
    kinds = lambda report: sorted(e.kind for e in report.converted if e.kind not in ("head", "attention"))
    assert kinds(ours) == kinds(theirs) == ["gated MLP"] * 2 + ["norm"] * 5
    assert abs(ours.reduction - theirs.reduction) < 0.01, (ours.reduction, theirs.reduction)
    torch.testing.assert_close(model(x), stock(x), rtol=1e-5, atol=1e-5)
    for m in (model, stock):
        m(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_rewritten_model_compiles_whole_and_matches_eager():
    x = zoo.tokens()
    torch.manual_seed(0)
    model = zoo.TitanTransformer()
    apply_lowmem(model, example_input=x)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), model(x))


class SharesBadly(nn.Module):
    """A norm whose input another op saves anyway and whose output a trainable scale saves too: the
    memory-sharing norm would add its ``z`` to both."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0, self.norm, self.fc1 = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)
        self.s, self.g = nn.Parameter(torch.ones(WIDTH)), nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc0(x)
        y = self.norm(x)
        return self.fc1(y) + y * self.g + x * self.s


def test_a_conversion_that_would_save_more_is_rolled_back_and_reported():
    model, x = SharesBadly(), torch.randn(4, 8, WIDTH)
    stock_bytes = saved(model, x)
    report = apply_lowmem(model, example_input=x)
    assert type(model.norm) is nn.LayerNorm and type(model.fc1) is nn.Linear  # every change undone
    assert report.saved_bytes_after == report.saved_bytes_before == stock_bytes == saved(model, x)
    assert report.status("norm") == "left alone" and not report.converted
    assert "rolled back: the converted model saved" in report.entries[0].detail and "rolled back" in str(report)
