"""Model surgery on real architectures (random init): outputs, gradients, checkpoints, memory."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import zoo
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.nn import GatedMLP, LowMemLinear, MemorySharingNorm, ReGELU2, ReSiLU2
from lightning_lowmem.surgery import apply as apply_module
from lightning_lowmem.surgery import apply_lowmem

timm = pytest.importorskip("timm")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


# -- models --------------------------------------------------------------------------------
def tiny_vit(targets: list[str] | None = None, dropout: float = 0.0) -> nn.Module:
    model = zoo.vit("vit_small_patch16_224", embed_dim=64, num_heads=2, num_classes=5)
    return zoo.lora(model, targets, random_b=True, lora_dropout=dropout) if targets else model


def tiny_llama(lora: bool = True) -> nn.Module:
    model = zoo.llama()
    return zoo.lora(model, zoo.LLAMA_LINEARS, random_b=True) if lora else model


def tiny_bert() -> nn.Module:
    return zoo.lora(zoo.bert(), ["query", "value"], random_b=True)


class Custom(nn.Module):
    """Pre-norm MLP blocks: a norm that feeds two linears, one feeding a residual, a shared
    activation module, and a functional SiLU that cannot be swapped."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm_a = nn.LayerNorm(dim)
        self.up, self.gate = nn.Linear(dim, 2 * dim), nn.Linear(dim, 2 * dim)
        self.act = nn.GELU(approximate="tanh")
        self.down = nn.Linear(2 * dim, dim)
        self.norm_b = nn.RMSNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.norm_c = nn.LayerNorm(dim)  # output also added to the residual stream
        self.mix = nn.Linear(dim, dim)
        self.acts = nn.ModuleList([nn.SiLU(), self.act])  # `act` is shared
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_a(x)
        x = x + self.down(self.act(self.up(h)) * self.acts[0](self.gate(h)))
        x = x + F.silu(self.proj(self.norm_b(x)))
        c = self.norm_c(x)
        x = c + self.acts[1](self.mix(c))
        return self.head(x)


def logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def converted(model: nn.Module, example, **options):
    twin = copy.deepcopy(model)
    report = apply_lowmem(twin, example_input=example, **options)
    return twin, report


def grads(model: nn.Module, example) -> dict[str, torch.Tensor]:
    """A training step's gradients, from one seed: the stochastic depth a timm model keeps (Swin's DropPath) drops
    the same paths in the stock and the converted model."""
    model.zero_grad(set_to_none=True)
    model.train()
    torch.manual_seed(0)
    out = logits(model(example) if not isinstance(example, dict) else model(**example))
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for name, expected in a.items():
        scale = expected.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(b[name], expected, rtol=rtol, atol=rtol * scale, msg=name)


def assert_same_outputs(a: nn.Module, b: nn.Module, example, tol: float = 1e-4) -> None:
    with torch.no_grad():
        ya, yb = logits(a.eval()(example)), logits(b.eval()(example))
    torch.testing.assert_close(yb, ya, rtol=tol, atol=tol * ya.abs().max().item())


def saved(model: nn.Module, example, autocast: bool) -> int:
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), SavedTensorMeter(model) as meter:
        logits(model(example)).float().sum().backward()
    return meter.total_bytes


def stock_twin(build, model: nn.Module) -> nn.Module:
    """A fresh unconverted model of the same architecture, loaded strictly from ``model``."""
    fresh = build()
    fresh.load_state_dict(model.state_dict(), strict=True)
    return fresh


# -- timm ViT --------------------------------------------------------------------------------
VIT_SETTINGS = {"full": None, "lora_qkv": ["qkv"], "lora_all": ["qkv", "proj", "fc1", "fc2"]}


@pytest.mark.parametrize("setting", list(VIT_SETTINGS))
def test_vit(setting):
    build = lambda: tiny_vit(VIT_SETTINGS[setting])
    stock, x = build(), zoo.images()
    model, report = converted(stock, x)
    assert isinstance(model.get_submodule(prefix(model) + "blocks.0.mlp.act"), ReGELU2)
    for block in ("blocks.0", "blocks.1"):
        for norm in ("norm1", "norm2"):
            assert report.status(prefix(model) + f"{block}.{norm}") == "converted"
    assert report.status(prefix(model) + "norm") == "converted"  # the head reads its class-token rows
    assert_same_outputs(stock, model, x)
    # every trainable parameter's gradient matches when only the norms change
    norm_only, _ = converted(stock, x, activation=False)
    assert_grads_close(grads(stock, x), grads(norm_only, x))
    # with the approximate (2-bit) activation derivative, gradients still point the same way
    flat = lambda g: torch.cat([v.flatten() for v in g.values()])
    assert F.cosine_similarity(flat(grads(stock, x)), flat(grads(model, x)), dim=0) > 0.7
    # checkpoints are interchangeable with the stock architecture, both ways
    assert_same_outputs(stock_twin(build, model), model, x)
    model.load_state_dict(stock.state_dict(), strict=True)
    for autocast in (False, True):
        assert saved(model, x, autocast) < 0.8 * saved(stock, x, autocast)


def prefix(model: nn.Module) -> str:
    return "base_model.model." if isinstance(model, peft.PeftModel) else ""


def test_vit_lora_fa_and_lora_gradients():
    stock = tiny_vit(["qkv", "fc1"])
    for name, param in stock.named_parameters():
        if "lora_A" in name:
            param.requires_grad_(False)  # LoRA-FA: A frozen, B trained
    x = zoo.images()
    model, report = converted(stock, x, activation=False)
    assert report.status("base_model.model.blocks.0.norm1") == "converted"
    g_stock, g_model = grads(stock, x), grads(model, x)
    assert all("lora_B" in n for n in g_stock)
    assert_grads_close(g_stock, g_model)


def test_lora_dropout_is_folded_into_lora_a_which_keeps_the_sharing():
    stock = tiny_vit(["qkv"], dropout=0.1)
    model, report = converted(stock, zoo.images(), activation=False)
    block = model.base_model.model.blocks[0]
    assert report.status("base_model.model.blocks.0.norm1") == "converted"
    assert report.status("base_model.model.blocks.0.attn.qkv.lora_dropout.default") == "converted"
    assert isinstance(block.attn.qkv.lora_dropout["default"], nn.Identity)
    lora_a = block.attn.qkv.lora_A["default"]
    assert isinstance(lora_a, LowMemLinear) and lora_a.dropout == 0.1 and lora_a.norm is block.norm1


def test_lora_dropout_left_stock_breaks_sharing_and_is_reported():
    stock = tiny_vit(["qkv"], dropout=0.1)
    model, report = converted(stock, zoo.images(), activation=False, dropout=False)
    entry = next(e for e in report.entries if e.name == "base_model.model.blocks.0.norm1")
    assert entry.status == "left alone" and "LoRA dropout" in entry.detail
    assert report.status("base_model.model.blocks.0.norm2") == "converted"  # fc1 has no LoRA
    torch.manual_seed(1)
    g_stock = grads(stock, zoo.images())
    torch.manual_seed(1)
    assert_grads_close(g_stock, grads(model, zoo.images()))


def test_autocast_shares_norm_output_and_saves_no_weight_copy():
    stock = tiny_vit()
    model, _ = converted(stock, zoo.images())
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16), SavedTensorMeter(model) as meter:
        out = model(zoo.images())
    weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    half_records = [r for r in meter.records if r.dtype == torch.bfloat16]
    assert not [r for r in half_records if r.shape in weight_shapes]
    assert not [r for r in meter.records if r.module.endswith(("qkv", "fc1"))]  # input shared with the norm
    out.float().sum().backward()


# -- timm model with norms that must not be converted ----------------------------------------
def test_swin_roll_keeps_norm1():
    build = lambda: timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, img_size=56, embed_dim=16,
        depths=(1, 1), num_heads=(1, 2), window_size=7, num_classes=4,
    )  # fmt: skip
    stock, x = build(), torch.randn(2, 3, 56, 56)
    model, report = converted(stock, x)
    by_name = {e.name: e for e in report.entries}
    assert by_name["layers.0.blocks.0.norm1"].status == "left alone"
    assert "no linear layer reads its output (first read by" in by_name["layers.0.blocks.0.norm1"].detail
    assert by_name["layers.0.blocks.0.norm2"].status == "converted"
    assert_same_outputs(stock, model, x)
    assert_grads_close(grads(stock, x), grads(converted(stock, x, activation=False)[0], x))
    stock_twin(build, model)


# -- Hugging Face ---------------------------------------------------------------------------
def test_llama_lora():
    torch.manual_seed(0)
    stock, x = tiny_llama(), zoo.tokens()
    model, report = converted(stock, x)
    base = "base_model.model.model."
    assert report.status(base + "layers.0.input_layernorm") == "converted"
    assert report.status(base + "layers.0.post_attention_layernorm") == "converted"
    assert report.status(base + "norm") == "converted"  # lm_head reads a slice of its rows
    assert isinstance(model.get_submodule(base + "layers.0.mlp"), GatedMLP)  # SiLU fused into the gated product
    assert report.status(base + "layers.0.mlp") == "converted"
    unfused = converted(stock, x, gated=False)[0]
    assert isinstance(unfused.get_submodule(base + "layers.0.mlp.act_fn"), ReSiLU2)
    detail = next(e.detail for e in report.entries if e.name == base + "layers.0.input_layernorm")
    assert all(f"self_attn.{p}_proj" in detail for p in "qkv")
    assert_same_outputs(stock, model, x)
    assert_grads_close(grads(stock, x), grads(converted(stock, x, activation=False)[0], x))
    torch.manual_seed(0)
    assert_same_outputs(stock_twin(tiny_llama, model), model, x)
    for autocast in (False, True):
        assert saved(model, x, autocast) < 0.9 * saved(stock, x, autocast)


def plain_bert(mlm: bool = False) -> nn.Module:  # BERT's proportions (intermediate = 4 x hidden), tiny
    return zoo.bert("BertForMaskedLM" if mlm else "BertForSequenceClassification", intermediate_size=256)


def test_bert_post_ln_norms_convert_and_residual_readers_get_the_stock_output():
    """Post-LN: each LayerNorm feeds the next sublayer's linears *and* the residual add."""
    torch.manual_seed(0)
    stock, x = tiny_bert(), zoo.tokens()
    model, report = converted(stock, x)
    base = "base_model.model.bert."
    assert report.status(base + "encoder.layer.0.intermediate.intermediate_act_fn") == "converted"
    for layer in ("0", "1"):
        assert report.status(base + f"encoder.layer.{layer}.attention.output.LayerNorm") == "converted"
    assert report.status(base + "embeddings.LayerNorm") == "converted"
    assert_same_outputs(stock, model, x)
    torch.manual_seed(0)
    assert_same_outputs(stock_twin(tiny_bert, model), model, x)
    assert_grads_close(grads(stock, x), grads(converted(stock, x, activation=False)[0], x))
    assert saved(model, x, False) < saved(stock, x, False)


def test_bert_full_fine_tuning_saves_a_third_and_converts_two_norms_per_layer():
    torch.manual_seed(0)
    stock, x = plain_bert(), zoo.tokens()
    model, report = converted(stock, x)
    assert not [e for e in report.entries if e.kind == "norm" and e.status != "converted"]
    assert "shared with bert.pooler.dense" in report.entries[-1].detail  # the pooler reads a slice of its rows
    assert sum(e.kind == "norm" for e in report.converted) == 1 + 2 * 2
    assert saved(model, x, False) <= 0.7 * saved(stock, x, False)
    _, mlm = converted(plain_bert(mlm=True), x)
    assert sum(e.kind == "norm" for e in mlm.converted) == 1 + 2 * 2 + 1  # embeddings, two per layer, MLM head
    assert_grads_close(grads(stock, x), grads(converted(stock, x, activation=False)[0], x))


def test_readers_the_example_call_never_exercised_get_the_stock_output():
    """hidden states asked for later, a kwarg-gated branch, a forward hook on the norm's output."""
    torch.manual_seed(0)
    stock, x = plain_bert(mlm=True), zoo.tokens()
    model, report = converted(stock, x)  # the example call returns logits only
    last = "bert.encoder.layer.1.output.LayerNorm"
    assert report.status(last) == "converted"
    with torch.no_grad():
        ours = model.eval()(x, output_hidden_states=True, return_dict=True).hidden_states
        theirs = stock.eval()(x, output_hidden_states=True, return_dict=True).hidden_states
        ours_tuple = model(x, output_hidden_states=True, return_dict=False)[1]
    for a, b, c in zip(theirs, ours, ours_tuple):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-4)
    seen = []
    model.get_submodule(last).register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    stock.get_submodule(last).register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    model.train()(x)
    stock.train()(x)
    torch.testing.assert_close(seen[0], seen[1], rtol=1e-4, atol=1e-4)


def test_a_kwarg_gated_branch_reads_the_stock_output():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)
            nn.init.normal_(self.norm.weight)

        def forward(self, x, extra: bool = False):
            h = self.norm(x)
            out = self.fc(h)
            return (out, h * 3) if extra else out

    stock, x = Branchy(), torch.randn(2, 16)
    model, report = converted(stock, x)
    assert report.status("norm") == "converted"
    out, h = model(x, extra=True)
    ref_out, ref_h = stock(x, extra=True)
    torch.testing.assert_close(h, ref_h)
    torch.testing.assert_close(out, ref_out)
    (out.sum() + h.square().sum()).backward()
    (ref_out.sum() + ref_h.square().sum()).backward()
    torch.testing.assert_close(model.norm.weight.grad, stock.norm.weight.grad)


# -- custom model, options, errors ----------------------------------------------------------
def test_custom_model():
    stock, x = Custom(), torch.randn(4, 8, 32)
    model, report = converted(stock, x)
    assert report.status("norm_a") == "converted" and report.status("norm_b") == "converted"
    assert report.status("norm_c") == "converted"  # its residual reader gets the stock output
    assert model.act is model.acts[1] and isinstance(model.act, ReGELU2)  # shared module, replaced everywhere
    assert model.act.approximate == "tanh" and isinstance(model.acts[0], ReSiLU2)
    functional = [e for e in report.entries if e.kind == "functional"]
    assert [(e.name, e.was) for e in functional] == [("<root>", "F.silu")]
    assert isinstance(model.up, LowMemLinear) and model.up.norm is model.norm_a
    assert_same_outputs(stock, model, x)
    assert_grads_close(grads(stock, x), grads(converted(stock, x, activation=False)[0], x))
    assert_same_outputs(stock_twin(Custom, model), model, x)
    assert "norm_c" in report.table() and "residual" not in report.summary()


def test_idempotent():
    stock, x = Custom(), torch.randn(2, 4, 32)
    model, _ = converted(stock, x)
    structure, state = repr(model), copy.deepcopy(model.state_dict())
    again = apply_lowmem(model, example_input=x)
    assert repr(model) == structure and not again.converted and again.linears == 0
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_without_an_example_the_first_training_forward_converts_on_its_own_input():
    stock, x = Custom(), torch.randn(2, 4, 32)
    _, with_example = converted(stock, x)
    model = copy.deepcopy(stock)
    report = apply_lowmem(model)
    assert report.pending and str(report).startswith("pending") and type(model.up) is nn.Linear
    with torch.no_grad():
        model(x)  # an evaluation forward saves nothing: it changes nothing
    assert report.pending and type(model.up) is nn.Linear
    with SavedTensorMeter(model) as meter:
        model(x)  # the first training forward: converted before it runs, then run converted
    assert not report.pending and report.probe == "model(tensor[2, 4, 32])"
    assert [(e.name, e.status) for e in report.entries] == [(e.name, e.status) for e in with_example.entries]
    assert report.saved_bytes_after == with_example.saved_bytes_after == meter.total_bytes
    assert isinstance(model.norm_a, MemorySharingNorm) and model.up.norm is model.norm_a
    assert_same_outputs(stock, model, x)


def test_a_first_forward_the_model_cannot_run_changes_nothing_and_raises_its_own_error():
    model, x = Custom(), torch.randn(2, 4, 32)
    report = apply_lowmem(model)
    structure = repr(model)
    with pytest.raises(RuntimeError, match=r"expected input with shape \[\*, 32\]"):
        model(torch.randn(2, 4, 31))  # the model's own error, from its own forward
    assert repr(model) == structure and report.pending
    model(x)  # the next training forward converts
    assert not report.pending and report.status("norm_a") == "converted"


def test_without_norms_nothing_waits_for_an_input():
    model = Custom()
    report = apply_lowmem(model, norm=False)
    assert not report.pending and report.status("act") == "converted" and report.saved_bytes_before is None


def test_include_exclude_and_bad_options():
    stock, x = Custom(), torch.randn(2, 4, 32)
    _, report = converted(stock, x, exclude=["norm_a", "acts.*"])
    assert report.status("norm_b") == "converted"
    assert "norm_a" not in {e.name for e in report.entries}
    _, report = converted(stock, x, include="norm_*", activation=False)
    assert {e.name for e in report.converted} == {"norm_a", "norm_b", "norm_c"}
    model, report = converted(stock, x, exclude="up")  # an excluded consumer stays stock, the other shares
    assert "shared with gate" in next(e.detail for e in report.entries if e.name == "norm_a")
    assert type(model.up) is nn.Linear and model.gate.norm is model.norm_a
    _, report = converted(stock, x, exclude=["up", "gate"])
    assert "consumer up is excluded" in next(e.detail for e in report.entries if e.name == "norm_a")
    with pytest.raises(ValueError, match="matches no module"):
        apply_lowmem(Custom(), include="nope.*")
    with pytest.raises(ValueError, match="activation must be"):
        apply_lowmem(Custom(), activation="fast")


def test_rejects_lookalikes():
    class ScaledSiLU(nn.Module):  # neither SiLU nor QuickGELU
        def forward(self, x):
            return x * torch.sigmoid(1.5 * x)

    class OuterEpsRMSNorm(nn.Module):  # eps added to the root, not under it
        def __init__(self, dim):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(dim)), 1e-6

        def forward(self, x):
            return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps) * self.weight

    model = nn.Sequential(OuterEpsRMSNorm(16), nn.Linear(16, 16), ScaledSiLU())
    report = apply_lowmem(model, example_input=torch.randn(2, 16))
    assert [e.status for e in report.entries] == ["left alone", "left alone"]
    assert "computes none of GELU (erf), GELU (tanh), SiLU, QuickGELU, Mish" in report.entries[1].detail


def test_every_registry_activation_converts_with_its_exact_forward():
    class QuickGELU(nn.Module):  # CLIP / OpenCLIP
        def forward(self, x):
            return x * torch.sigmoid(1.702 * x)

    stock = nn.Sequential(nn.Linear(8, 8), QuickGELU(), nn.Linear(8, 8), nn.Mish(), nn.Linear(8, 8), nn.GELU())
    x = torch.randn(4, 8)
    model, report = converted(stock, x, bits=4)
    assert [e.detail for e in report.converted] == [
        "LowMemActivation (QuickGELU), 4-bit",
        "LowMemActivation (Mish), 4-bit",
        "ReGELU2 (erf), 4-bit",
    ]
    assert torch.equal(model.eval()(x), stock.eval()(x))
    model.train()
    with SavedTensorMeter(model) as meter:
        model(x).sum().backward()
    assert {r.dtype for r in meter.records if r.module in ("1", "3", "5")} == {torch.uint8}


def test_hooked_modules_are_left_alone():
    model, x = Custom(), torch.randn(2, 4, 32)
    seen = []
    model.up.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    model.act.register_forward_pre_hook(lambda m, a: None)
    report = apply_lowmem(model, example_input=x)
    assert "shared with gate" in next(e.detail for e in report.entries if e.name == "norm_a")  # not up
    assert "has hooks" in next(e.detail for e in report.entries if e.name == "act")
    assert type(model.up) is nn.Linear and isinstance(model.norm_a, MemorySharingNorm)
    model(x)
    assert seen


def test_failed_verification_rolls_back(monkeypatch):
    model, x = Custom(), torch.randn(2, 4, 32)
    structure = repr(model)

    def mismatch(*args):
        raise RuntimeError("output 0 of the converted model differs")

    monkeypatch.setattr(apply_module, "verify", mismatch)
    with pytest.raises(RuntimeError, match="differs"):
        apply_lowmem(model, example_input=x)
    assert repr(model) == structure and type(model.up) is nn.Linear


def test_peft_input_cast_is_switched_off():
    model, _ = converted(tiny_vit(["qkv"]), zoo.images())
    assert model.base_model.model.blocks[0].attn.qkv.cast_input_dtype_enabled is False
    assert model.base_model.model.blocks[0].mlp.fc1.__class__ is LowMemLinear


def test_under_gradient_checkpointing_the_report_gives_the_steps_saving():
    """Hugging Face's ``gradient_checkpointing``: one forward saves only each layer's input and what lies outside the
    layers, the layers' recompute saves the rest in backward. The report measures what a training step holds at its
    peak, stock and converted, gives that saving and says so; the figures are a measured step's."""
    from benchmarks import zoo
    from lightning_lowmem.surgery.measure import step_peak

    model = zoo.lora(zoo.llama(), zoo.LLAMA_LINEARS)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, zoo.VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    stock = copy.deepcopy(model)
    report = apply_lowmem(model, example_input=batch)
    assert report.step_bytes_before == step_peak(stock, batch) and report.step_bytes_after == step_peak(model, batch)
    assert report.reduction == 1 - report.step_bytes_after / report.step_bytes_before > 0.1
    assert "a training step's activations at their peak (measured" in report.summary()
    plain = apply_lowmem(zoo.lora(zoo.llama(), zoo.LLAMA_LINEARS), example_input=batch)
    assert plain.step_bytes_before is None and "saved for backward by one forward:" in plain.summary()
