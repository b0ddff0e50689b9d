"""The surgery stage by stage (nominate, probe, plan: nothing changes until the changes apply), the adapters of
each library, and hand-written LoRA layers found by their data flow: no more saved than peft's LoRA on the same
model, at dropout 0 as at 0.05, with stock outputs and adapter gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import zoo
from lightning_lowmem import apply_lowmem
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.nn import GatedMLPBase, MemorySharingNorm
from lightning_lowmem.nn.adapters import ADAPTERS, adapter_of, saves_its_input
from lightning_lowmem.nn.adapters.dataflow import RECORD
from lightning_lowmem.surgery.apply import make_plan, nominate, run, trace_norms
from lightning_lowmem.surgery.changes import Install, Replace
from lightning_lowmem.surgery.families import FAMILIES
from lightning_lowmem.surgery.options import SWITCHES, Options
from lightning_lowmem.surgery.report import LowMemReport


class ChildLoRA(nn.Module):
    """A hand-written LoRA layer with linear children (torchtune's ``LoRALinear`` keeps them so)."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0, dropout: float = 0.0) -> None:
        super().__init__()
        self.linear = base
        self.lora_a = nn.Linear(base.in_features, r, bias=False)
        self.lora_b = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.lora_b(self.lora_a(self.dropout(x))) * self.scaling


class ParamLoRA(nn.Module):
    """A hand-written LoRA layer with Parameters (microsoft/LoRA's ``loralib.Linear`` computes it so)."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0, dropout: float = 0.0) -> None:
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) * 0.02)
        self.lora_B = nn.Parameter(torch.randn(base.out_features, r) * 0.02)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        return (
            result + (self.lora_dropout(x) @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)) * self.scaling
        )


class TransposedLoRA(ParamLoRA):
    """``x @ A @ B`` with ``A`` stored ``(in, r)`` (Sebastian Raschka's ``LoRALayer``), the scale first."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0, dropout: float = 0.0) -> None:
        super().__init__(base, r, alpha, dropout)
        self.lora_A = nn.Parameter(torch.randn(base.in_features, r) * 0.02)
        self.lora_B = nn.Parameter(torch.randn(r, base.out_features) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.scaling * (self.lora_dropout(x) @ self.lora_A @ self.lora_B)


class TorchtuneLoRA(nn.Module):
    """torchtune's ``LoRALinear``, as it computes: its own base weight, ``lora_a`` / ``lora_b`` children, the scale
    after ``B``, a ``disabled`` switch."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0, dropout: float = 0.0) -> None:
        super().__init__()
        self.rank, self.alpha, self.disabled = r, alpha, False
        self.weight, self.bias = base.weight, base.bias
        self.dropout = nn.Dropout(p=dropout) if dropout > 0.0 else nn.Identity()
        self.lora_a = nn.Linear(base.in_features, r, bias=False)
        self.lora_b = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.disabled:
            return out
        lora_out = self.lora_a(self.dropout(x))
        lora_out = (self.alpha / self.rank) * self.lora_b(lora_out)
        return out + lora_out


def hand_written(cls: type[nn.Module], dropout: float) -> nn.Module:
    """The tiny LLaMA with ``cls`` on every linear layer of its blocks, only the adapters trainable."""
    model = zoo.llama()
    for module in list(model.modules()):
        for child, layer in list(module.named_children()):
            if child in zoo.LLAMA_LINEARS:
                setattr(module, child, cls(layer, dropout=dropout))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora" in name)
    return model


def batch() -> dict[str, torch.Tensor]:
    return {"input_ids": zoo.tokens(), "labels": zoo.tokens()}


def saved_bytes(model: nn.Module, example: dict) -> int:
    with SavedTensorMeter() as meter:
        loss = model(**example).loss
    del loss
    return meter.total_bytes


@pytest.mark.parametrize("dropout", [0.0, 0.05])
@pytest.mark.parametrize("cls", [ChildLoRA, ParamLoRA, TransposedLoRA, TorchtuneLoRA])
def test_hand_written_lora_keeps_no_more_than_peft(cls, dropout):
    example = batch()
    peft_model = zoo.lora(zoo.llama(), zoo.LLAMA_LINEARS, lora_dropout=dropout)
    apply_lowmem(peft_model, example)
    model = hand_written(cls, dropout)
    stock = copy.deepcopy(model)
    report = apply_lowmem(model, example)

    layers = [e for e in report.converted if e.kind == "LoRA"]
    assert len(layers) == 14 and all("test_families.py:" in e.detail for e in layers)  # by call site
    assert {e.kind for e in report.converted} >= {"gated MLP", "norm", "head"}
    assert saved_bytes(model.train(), example) <= saved_bytes(peft_model.train(), example)
    assert saved_bytes(model, example) < saved_bytes(stock.train(), example)
    again = apply_lowmem(model, example)  # a second run changes nothing and says so
    assert {e.name for e in again.entries if e.kind == "LoRA" and e.status == "already converted"} == {
        e.name for e in layers
    }
    stock.eval(), model.eval()  # the dropout masks differ (seeded): compare without them
    torch.testing.assert_close(model(**example).logits, stock(**example).logits, rtol=1e-5, atol=1e-5)
    if dropout == 0:  # exact ops: the adapters' gradients are stock's
        stock.train(), model.train()
        model(**example).loss.backward(), stock(**example).loss.backward()
        ours, theirs = dict(model.named_parameters()), dict(stock.named_parameters())
        for name in (n for n in ours if "lora" in n):
            torch.testing.assert_close(ours[name].grad, theirs[name].grad, rtol=1e-4, atol=1e-6)


def test_hand_written_lora_dropout_folds_into_its_first_product():
    """Trained at dropout 0.05: the layer saves its input (the norm's z) and a seed; its gradients are those of
    the stock layer given the same dropped input."""
    layer = ChildLoRA(nn.Linear(8, 6), dropout=0.5)
    model = nn.Sequential(nn.LayerNorm(8), layer)
    report = apply_lowmem(model, torch.randn(3, 8))
    assert report.status("1") == "converted" and report.status("1.dropout") == "converted"
    assert "folded into lora_a (p=0.5)" in next(e.detail for e in report.entries if e.name == "1.dropout")
    x = torch.randn(3, 8, requires_grad=True)
    with SavedTensorMeter() as meter:
        model(x)
    assert meter.total_bytes < 3 * 8 * 4 * 2 + 1024  # z (+ rstd, seed): no dropped copy, no mask
    assert adapter_of(layer).name == "hand-written" and saves_its_input(layer)


def test_a_forward_computing_something_else_is_no_lora():
    class NotLoRA(ChildLoRA):
        def forward(self, x):  # B(A(.)) of the base's output, not of x
            y = self.linear(x)
            return y + self.lora_b(self.lora_a(y)) * self.scaling

    model = nn.Sequential(nn.LayerNorm(8), NotLoRA(nn.Linear(8, 8)))
    report = apply_lowmem(model, torch.randn(3, 8))
    assert not any(e.kind == "LoRA" for e in report.entries)
    assert RECORD not in model[1].__dict__ and "forward" not in model[1].__dict__


def test_lora_switch_leaves_hand_written_and_litgpt_layers_alone():
    model = hand_written(ChildLoRA, 0.0)
    report = apply_lowmem(model, batch(), lora=False)
    assert not any(e.kind == "LoRA" for e in report.entries)
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, ChildLoRA))


def test_rollback_removes_the_rewritten_forward_and_its_record():
    model = hand_written(ParamLoRA, 0.05)
    surgery = run(LowMemReport(), model, Options(), batch())
    layer = model.model.layers[0].self_attn.q_proj
    assert RECORD in layer.__dict__ and "forward" in layer.__dict__
    surgery.rollback()
    assert RECORD not in layer.__dict__ and "forward" not in layer.__dict__


def test_litgpt_lora_layers_have_entries():
    pytest.importorskip("litgpt")
    model = zoo.litgpt_model("Llama-2-7b-hf", lora=True, lora_dropout=0.05)
    report = apply_lowmem(model, zoo.tokens())
    layers = [e for e in report.converted if e.kind == "LoRA"]
    assert layers and all(e.detail.startswith("LitGPT forward") for e in layers)
    assert all("dropout folded (p=0.05)" in e.detail for e in layers)
    again = apply_lowmem(model, zoo.tokens())
    assert {e.name for e in again.entries if e.kind == "LoRA" and e.status == "already converted"} == {
        e.name for e in layers
    }


# -- the stages: each decides, none changes the model -----------------------------------------------------------


def test_nominate_finds_each_familys_candidates_and_changes_nothing():
    model = zoo.llama()
    before = {name: id(module) for name, module in model.named_modules()}
    found = nominate(model, Options(), batch())  # the head's loss is computed on it: nothing changes either
    assert set(found["gated MLP"]) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert found.claimed == {"model.layers.0.mlp.act_fn", "model.layers.1.mlp.act_fn"}
    assert not found["activation"]  # claimed by the gated MLPs
    assert len(found["norm"]) == 5 and found.norms["model.norm"] == (zoo.HIDDEN,)
    assert found["linear"]["model.layers.0.self_attn.q_proj"] == "linear"
    assert list(found["head"]) == [""] and found["head"][""].shift  # transformers' loss: labels shifted
    assert nominate(model, Options()).entries[":head"].detail == "no example input to check its loss on"
    assert before == {name: id(module) for name, module in model.named_modules()}


def test_probe_records_the_linear_readers_of_each_norm():
    model = zoo.llama()
    found = nominate(model, Options())
    flow = trace_norms(model, found, batch())
    readers = {read.where for read in flow.reads["model.layers.0.input_layernorm"]}
    assert {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"} <= readers
    assert not flow.blocked


def test_plan_is_a_list_of_changes_that_changes_nothing():
    model = zoo.llama()
    found = nominate(model, Options(), batch())
    flow = trace_norms(model, found, batch())
    plan = make_plan(model, found, flow, Options())
    named = dict(model.named_modules())
    replaced = {change.old: change.new for change in plan.changes if isinstance(change, Replace)}
    assert isinstance(replaced[named["model.layers.0.input_layernorm"]], MemorySharingNorm)
    assert isinstance(replaced[named["model.layers.0.mlp"]], GatedMLPBase)
    assert plan.norm_of["model.layers.0.self_attn.q_proj"] is replaced[named["model.layers.0.input_layernorm"]]
    assert any(isinstance(c, Install) and c.module is model and c.method == "forward" for c in plan.changes)
    assert all(type(m) is not MemorySharingNorm for m in model.modules())  # nothing applied
    assert "forward" not in model.__dict__


def test_families_and_adapters_are_registries():
    assert all(family.switch in SWITCHES for family in FAMILIES)
    assert len({type(f) for f in FAMILIES}) == len(FAMILIES)
    names = [adapter.name for adapter in ADAPTERS]
    assert set(names) == {"torch", "peft", "LitGPT", "bitsandbytes", "hand-written"} and names[-1] == "torch"
    peft_model = zoo.lora(zoo.llama(), ["q_proj"])
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert adapter_of(layer).name == "peft" and adapter_of(layer.base_layer).name == "torch"
    assert adapter_of(nn.LayerNorm(4)) is None


@pytest.mark.parametrize("cls", [ChildLoRA, ParamLoRA])
def test_hand_written_lora_compiles_whole(cls):
    """The rewritten forward under ``torch.compile(fullgraph=True)``: no graph break, eager's loss and gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), cls(nn.Linear(16, 12), dropout=0.0))
    apply_lowmem(model, torch.randn(2, 5, 16))
    x = torch.randn(2, 5, 16)
    eager = model(x).square().sum()
    grads = torch.autograd.grad(eager, list(model.parameters()))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x).square().sum()
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(torch.autograd.grad(compiled, list(model.parameters())), grads):
        torch.testing.assert_close(got, want)
