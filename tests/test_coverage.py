"""The model zoo (``benchmarks/zoo.py``): what each family converts, with every guarantee checked.

For each tiny random-init model: the expected conversions, outputs and every returned hidden state
unchanged, gradients exactly the stock ones when only norms (and exact fused gated MLPs) change,
checkpoints interchangeable with the stock model (strict), a second ``apply_lowmem`` changing
nothing, the activation memory saved, and every norm-sharing layer saving the norm's own tensor
(by storage pointer). Then the new consumers, norm variants and gated layouts one by one.
"""

from __future__ import annotations

import copy
import functools
from collections import defaultdict
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.zoo import FAMILIES, Family
from lightning_lowmem import apply_lowmem
from lightning_lowmem.nn import (
    LowMemLinear,
    LowMemTransposedLinear,
    MemorySharingNorm,
    MSRMSNorm,
    PackedGatedMLP,
    T5GatedMLP,
)
from lightning_lowmem.surgery.example import tensors_in

pytest.importorskip("transformers")
pytest.importorskip("timm")


class Expect(NamedTuple):
    norms: int  # converted
    left: int  # norms left alone
    activations: int
    gated: int
    saving: float  # minimum fraction of saved-for-backward bytes removed (fp32)


EXPECTED = {
    "BertForSequenceClassification": Expect(5, 0, 2, 0, 0.33),
    "RobertaForSequenceClassification": Expect(5, 0, 2, 0, 0.33),
    "ElectraForSequenceClassification": Expect(5, 0, 3, 0, 0.33),
    "DebertaV2ForSequenceClassification": Expect(4, 1, 2, 0, 0.30),  # embeddings: multiplied by the mask
    "DistilBertForSequenceClassification": Expect(5, 0, 2, 0, 0.33),
    "BartForSequenceClassification": Expect(6, 1, 2, 0, 0.30),  # the head gathers <eos> rows (a copy)
    "T5ForConditionalGeneration": Expect(6, 1, 0, 2, 0.45),  # decoder's final norm: a dropout reads it
    "GPT2LMHeadModel": Expect(5, 0, 2, 0, 0.55),
    "FalconForCausalLM": Expect(3, 0, 2, 0, 0.35),
    "LlamaForCausalLM": Expect(5, 0, 0, 2, 0.45),
    "Phi3ForCausalLM": Expect(5, 0, 0, 2, 0.40),
    "GemmaForCausalLM": Expect(5, 0, 0, 2, 0.45),
    "Gemma2ForCausalLM": Expect(5, 4, 0, 2, 0.30),  # post-sublayer norms: only a residual add reads them
    "litgpt Llama-2-7b-hf": Expect(5, 0, 0, 2, 0.50),  # its MLP's F.silu(fc_1(x)) * fc_2(x) fused by data flow
    "litgpt pythia-160m": Expect(5, 0, 2, 0, 0.40),  # F.gelu in its MLP's forward
    "litgpt phi-2": Expect(3, 0, 2, 0, 0.42),  # one norm for attention and MLP
    "litgpt Gemma-2b": Expect(5, 0, 0, 2, 0.50),
    "vit_small_patch16_224": Expect(5, 0, 2, 0, 0.30),
    "beit_base_patch16_224": Expect(5, 0, 2, 0, 0.27),
    "eva02_tiny_patch14_224": Expect(5, 0, 0, 2, 0.27),
}
POST_LN = [name for name in EXPECTED if name.split("For")[0] in ("Bert", "Roberta", "Electra", "DistilBert")]


def test_every_family_has_expectations():
    assert set(EXPECTED) == set(FAMILIES)


def build(family: Family) -> nn.Module:
    torch.manual_seed(0)
    return family.build().eval()


def example(family: Family):
    torch.manual_seed(1)
    return family.example()


class Converted(NamedTuple):
    stock: nn.Module
    model: nn.Module
    report: Any
    example: Any


@functools.cache
def converted(name: str, activation: bool = True) -> Converted:
    """The family's stock model and its converted twin, built once for the tests that only look at them."""
    family = FAMILIES[name]
    stock, x = build(family), example(family)
    model = copy.deepcopy(stock)
    return Converted(stock, model, apply_lowmem(model, example_input=x, activation=activation), x)


def outputs(family: Family, model: nn.Module, x, hidden_states: bool = True) -> list[torch.Tensor]:
    with torch.no_grad():
        return tensors_in(family.call(model.eval(), x, hidden_states))


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(y, x, rtol=tol, atol=tol * max(x.abs().max().item(), 1.0), msg=f"output {i}")


def grads(family: Family, model: nn.Module, x) -> dict[str, torch.Tensor]:
    model.train().zero_grad(set_to_none=True)
    for i, out in enumerate(tensors_in(family.call(model, x, hidden_states=True))):
        (out.float().square().mean() * (i + 1)).backward(retain_graph=True)
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def counts(report, status: str = "converted") -> dict[str, int]:
    found: dict[str, int] = defaultdict(int)
    for entry in report.entries:
        if entry.status == status:
            found[entry.kind] += 1
    return found


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family(name):
    family, expect = FAMILIES[name], EXPECTED[name]
    stock, model, report, x = converted(name)
    done, left = counts(report), counts(report, "left alone")
    assert (done["norm"], left["norm"]) == (expect.norms, expect.left), report.table()
    assert (done["activation"], done["gated MLP"]) == (expect.activations, expect.gated), report.table()
    assert report.reduction >= expect.saving, report.summary()
    # outputs and every hidden state the model can return (the example call asked for none of them)
    assert_same(outputs(family, stock, x), outputs(family, model, x))
    # checkpoints load strictly both ways and mean the same model
    fresh = family.build().eval()
    fresh.load_state_dict(model.state_dict(), strict=True)
    assert_same(outputs(family, model, x), outputs(family, fresh, x))
    model.load_state_dict(stock.state_dict(), strict=True)
    # a second run changes nothing
    structure = repr(model)
    again = apply_lowmem(model, example_input=x)
    assert not again.converted and again.linears == 0 and repr(model) == structure


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_norm_gradients_are_the_stock_ones(name):
    """Memory-sharing norms, their consumers and the fused gated MLPs are exact: every gradient matches."""
    family = FAMILIES[name]
    stock, model, _, x = converted(name, activation=False)
    expected, ours = grads(family, stock, x), grads(family, model, x)
    assert expected.keys() == ours.keys()
    for param, grad in expected.items():
        torch.testing.assert_close(ours[param], grad, rtol=1e-4, atol=1e-4 * grad.abs().max().item() + 1e-7)


def saved_storages(family: Family, model: nn.Module, x) -> tuple[dict[str, set[int]], object]:
    """Storage pointers each module (innermost running) saved for backward, parameters excluded; and the
    output, which keeps the graph and so those storages alive while the pointers are compared."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[str] = []
    saved: dict[str, set[int]] = defaultdict(set)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[stack[-1]].add(t.untyped_storage().data_ptr())
        return t

    def enter(module: nn.Module, args: tuple) -> None:
        stack.append(names[module])

    def leave(module: nn.Module, args: tuple, output: object) -> None:
        stack.pop()

    names = {module: module_name for module_name, module in model.named_modules()}
    handles = [h for m in names for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = family.call(model.train(), x)
    finally:
        for handle in handles:
            handle.remove()
    return saved, out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_consumers_save_the_norms_own_tensor(name):
    family = FAMILIES[name]
    _, model, _, x = converted(name)
    names = {module: module_name for module_name, module in model.named_modules()}
    saved, _ = saved_storages(family, model, x)
    consumers = [m for m in model.modules() if isinstance(m, (LowMemLinear, LowMemTransposedLinear)) and m.norm]
    assert consumers
    for layer in consumers:  # called on the norm's output (or a view of its rows): saves only its tensor
        assert saved[names[layer]] <= saved[names[layer.norm]], names[layer]


SHARED = {  # family: (norm, module saving its tensor) for the new kinds of consumer
    "GPT2LMHeadModel": [("transformer.h.0.ln_1", "transformer.h.0.attn.c_attn"), ("transformer.ln_f", "lm_head")],
    "FalconForCausalLM": [("transformer.h.0.input_layernorm", "transformer.h.0.self_attention.query_key_value")],
    "BertForSequenceClassification": [("bert.encoder.layer.1.output.LayerNorm", "bert.pooler.dense")],
    "beit_base_patch16_224": [("blocks.0.norm1", "blocks.0.attn")],  # F.linear(x, self.qkv.weight, qkv_bias)
    "eva02_tiny_patch14_224": [("blocks.1.norm1", "blocks.1.attn")],
    "GemmaForCausalLM": [("model.layers.0.input_layernorm", "model.layers.0.self_attn.q_proj")],
    "Phi3ForCausalLM": [("model.layers.0.post_attention_layernorm", "model.layers.0.mlp.gate_up_proj")],
    "T5ForConditionalGeneration": [
        ("encoder.block.0.layer.1.layer_norm", "encoder.block.0.layer.1.DenseReluDense.wi_0")
    ],
}


@pytest.mark.parametrize("name", list(SHARED))
def test_new_consumers_share_by_pointer(name):
    family = FAMILIES[name]
    stock, model, _, x = converted(name)
    ours, _ = saved_storages(family, model, x)
    theirs, _ = saved_storages(family, stock, x)
    for norm, reader in SHARED[name]:
        assert ours[norm] & ours[reader], (norm, reader)  # the reader saves the norm's tensor
        assert not theirs[norm] & theirs[reader]  # where the stock pair keeps two


def test_gpt2_conv1d_and_falcon_linear_become_low_memory_layers_with_their_parameters():
    stock, gpt2, report, _ = converted("GPT2LMHeadModel")
    c_attn = gpt2.transformer.h[0].attn.c_attn
    assert isinstance(c_attn, LowMemTransposedLinear) and c_attn.norm is not None
    assert torch.equal(c_attn.weight, stock.transformer.h[0].attn.c_attn.weight)  # (in, out), as Conv1D keeps it
    assert isinstance(gpt2.transformer.h[0].attn.c_proj, LowMemTransposedLinear)  # recast, no norm
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight  # tied weights stay tied
    assert "shared with attn.c_attn" in next(e.detail for e in report.entries if e.name == "transformer.h.0.ln_1")
    falcon = converted("FalconForCausalLM").model
    assert type(falcon.transformer.h[0].self_attention.query_key_value) is LowMemLinear


def test_a_linear_lookalike_is_decided_by_what_it_computes():
    class Doubling(nn.Linear):  # an nn.Linear subclass computing something else
        def forward(self, x):
            return 2 * F.linear(x, self.weight, self.bias)

    class Transposed(nn.Module):  # no nn.Linear at all, but x @ W + b
        def __init__(self):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(16, 16)), nn.Parameter(torch.randn(16))

        def forward(self, x):
            return x @ self.weight + self.bias

    model = nn.Sequential(nn.LayerNorm(16), Doubling(16, 16), nn.LayerNorm(16), Transposed())
    stock, x = copy.deepcopy(model), torch.randn(2, 3, 16)
    report = apply_lowmem(model, example_input=x)
    assert report.status("0") == "left alone" and "Doubling 1" in report.entries[0].detail
    assert type(model[1]) is Doubling and isinstance(model[3], LowMemTransposedLinear)
    torch.testing.assert_close(model(x), stock(x))


def test_gemma_norms_scale_by_one_plus_weight():
    stock, model, _, _ = converted("GemmaForCausalLM")
    norm = model.model.layers[0].input_layernorm
    assert isinstance(norm, MSRMSNorm) and norm.weight_offset == 1.0 and "weight_offset=1.0" in repr(norm)
    assert torch.equal(norm.weight, stock.model.layers[0].input_layernorm.weight)  # the stock parameter, as it is


def test_a_norm_with_any_scale_offset_the_probe_identifies():
    class OffsetLayerNorm(nn.LayerNorm):  # Megatron's zero-centred gamma: (1 + w) * z + b; here 0.5 + w
        def forward(self, x):
            return F.layer_norm(x, self.normalized_shape, self.weight + 0.5, self.bias, self.eps)

    model = nn.Sequential(OffsetLayerNorm(16), nn.Linear(16, 8))
    nn.init.normal_(model[0].weight)
    stock, x = copy.deepcopy(model), torch.randn(4, 16)
    report = apply_lowmem(model, example_input=x)
    assert report.status("0") == "converted" and model[0].weight_offset == 0.5
    torch.testing.assert_close(model(x), stock(x))
    (model(x) ** 2).sum().backward()
    (stock(x) ** 2).sum().backward()
    for ours, theirs in zip(model.parameters(), stock.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad)


@pytest.mark.parametrize("name, cls", [("Phi3ForCausalLM", PackedGatedMLP), ("T5ForConditionalGeneration", T5GatedMLP)])
def test_packed_and_t5_gated_mlps_fuse_with_their_child_names(name, cls):
    stock, model, _, _ = converted(name)
    fused = [m for m in model.modules() if isinstance(m, cls)]
    assert fused and all(m.resolved_mode() == "gate" for m in fused)  # the down projection trains: shares h
    assert list(model.state_dict()) == list(stock.state_dict())


def test_t5_gated_mlp_with_dropout_keeps_gate_and_up():
    """T5's dropout sits between the product and ``wo``: left stock, ``wo`` saves a dropped copy, so the op keeps
    gate and up; folded into ``wo`` (the default), ``wo`` reads the product itself, which the op then shares."""
    import transformers

    config = transformers.T5Config(
        vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4, feed_forward_proj="gated-gelu",
        dropout_rate=0.1,
    )  # fmt: skip
    stock = nn.Sequential(transformers.models.t5.modeling_t5.T5DenseGatedActDense(config))
    model, x = copy.deepcopy(stock), torch.randn(2, 5, 16)
    report = apply_lowmem(model, example_input=x, dropout=False)  # the stock dropout, for the same mask below
    assert isinstance(model[0], T5GatedMLP) and report.converted[0].detail == "GeGLU (tanh) fused, saves gate and up"
    torch.manual_seed(3)
    ours = model.train()(x)
    torch.manual_seed(3)
    torch.testing.assert_close(ours, stock.train()(x))  # the same dropout mask: the same function
    folded = copy.deepcopy(stock)
    report = apply_lowmem(folded, example_input=x)
    assert isinstance(folded[0].dropout, nn.Identity) and folded[0].wo.dropout == 0.1
    assert folded[0].resolved_mode() == "gate" and report.status("0.dropout") == "converted"


@pytest.mark.parametrize("name", POST_LN)
def test_post_ln_encoders_convert_two_norms_per_layer(name):
    report = converted(name).report
    layers = [e.name for e in report.converted if e.kind == "norm" and "embeddings" not in e.name]
    assert len(layers) == 2 * 2  # both norms of both layers, the last one read by the classifier's slice


def test_functional_sharing_is_undone_by_rollback_and_not_repeated():
    family = FAMILIES["beit_base_patch16_224"]
    model, x = build(family), example(family)
    structure = repr(model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("lightning_lowmem.surgery.apply.verify", lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
        with pytest.raises(RuntimeError):
            apply_lowmem(model, example_input=x)
    assert repr(model) == structure and not model.blocks[0].attn._forward_pre_hooks
    apply_lowmem(model, example_input=x)
    hooks = len(model.blocks[0].attn._forward_pre_hooks)
    apply_lowmem(model, example_input=x)
    assert hooks == len(model.blocks[0].attn._forward_pre_hooks) == 1


def test_views_of_whole_rows_only():
    """A linear reading a view that splits rows (the affine would not line up) saves its own input."""

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.per_head = nn.LayerNorm(16), nn.Linear(4, 4)
            nn.init.normal_(self.norm.weight)

        def forward(self, x):
            return self.per_head(self.norm(x).view(*x.shape[:-1], 4, 4))

    model, x = Heads(), torch.randn(2, 3, 16)
    report = apply_lowmem(model, example_input=x)
    assert report.status("norm") == "left alone" and "a reshape" in report.entries[0].detail
    assert isinstance(model.norm, nn.LayerNorm) and not isinstance(model.norm, MemorySharingNorm)


def test_a_norm_output_changed_in_place_is_not_shared():
    """After ``y.mul_(2)`` the output is no longer ``gamma * z + beta``: its reader saves its own input, and the
    weight gradient stays the stock one."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)
            nn.init.normal_(self.norm.weight)

        def forward(self, x):
            return self.fc(self.norm(x).mul_(2))

    stock, x = Scaled(), torch.randn(2, 3, 16)
    model = copy.deepcopy(stock)
    report = apply_lowmem(model, example_input=x)
    assert report.status("norm") == "left alone" and "an in-place product" in report.entries[0].detail
    model(x).square().sum().backward()
    stock(x).square().sum().backward()
    for ours, theirs in zip(model.parameters(), stock.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad)
