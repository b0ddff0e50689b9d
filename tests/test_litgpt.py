"""LitGPT (random-init ``litgpt.GPT`` / ``litgpt.lora.GPT`` of real architectures): its LoRA layers share their
norm's tensor and fold their dropout, its attention holds no ``qkv`` output, and it saves no more than the same
architecture from Hugging Face + peft; outputs, gradients, merging, compile, and ``LowMemBP`` without an
example input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from benchmarks import zoo
from lightning_lowmem import apply_lowmem, kernels
from lightning_lowmem.nn.adapters.litgpt import LoRAForward, attention_layout_of, lora_forward_of

lora = pytest.importorskip("litgpt.lora")

ARCHITECTURES = list(zoo.LITGPT_TWINS)
CPU = torch.device("cpu")


def bf16_lora(build, dropout: float) -> nn.Module:
    """A model of ``build`` with adapters of ``dropout``, its weights in bf16 (adapters trainable)."""
    torch.manual_seed(0)
    return build(lora=True, lora_dropout=dropout).to(torch.bfloat16)


def converted(model: nn.Module, example) -> object:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return apply_lowmem(model, example_input=example)


@pytest.mark.parametrize("dropout", [0.0, 0.05])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_litgpt_lora_model_saves_no_more_than_the_same_hugging_face_peft_model(name, dropout):
    """bf16 weights, bf16 autocast, LoRA on every linear layer and the head: LitGPT's converted model saves at
    most what the Hugging Face + peft twin's converted model saves, and computes the stock outputs."""
    x = zoo.tokens()
    stock = bf16_lora(lambda **kw: zoo.litgpt_model(name, **kw), dropout)
    model = copy.deepcopy(stock)
    ours = converted(model, x)
    twin = converted(bf16_lora(lambda **kw: zoo.hf_twin(name, **kw), dropout), {"input_ids": x, "use_cache": False})
    assert ours.saved_bytes_after <= twin.saved_bytes_after, (ours.summary(), twin.summary())
    assert ours.reduction > 0.35, ours.summary()
    kinds = {e.kind for e in ours.converted}
    assert {"norm", "attention"} <= kinds and kinds & {"gated MLP", "activation"}, ours.table()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = stock.eval()(x).float(), model.eval()(x).float()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("name", ["Llama-2-7b-hf", "pythia-160m"])
def test_lora_gradients_are_the_stock_ones(name):
    """fp32, exact parts only (norms, fused gated MLPs, shared LoRA adapters, attention layout): every LoRA
    gradient is the stock one."""
    x = zoo.tokens()
    torch.manual_seed(0)
    stock = zoo.litgpt_model(name, lora=True)
    for p in stock.parameters():  # B starts at zero: give the adapters something to change
        if p.requires_grad:
            nn.init.normal_(p, std=0.02)
    model = copy.deepcopy(stock)
    report = apply_lowmem(model, example_input=x, activation=False)
    assert report.status("transformer.h.0.norm_1") == "converted"
    qkv = model.transformer.h[0].attn.qkv
    assert lora_forward_of(qkv).norm is model.transformer.h[0].norm_1  # the adapter shares the norm's tensor
    for m in (model, stock):
        m.train()(x).square().mean().backward()
    for (param, ours), theirs in zip(model.named_parameters(), stock.parameters()):
        if theirs.grad is not None:
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-7, msg=param)


@pytest.mark.parametrize("layer", ["attn.qkv", "mlp.fc_2"])
def test_a_folded_lora_dropout_computes_lora_on_the_regenerated_mask(layer):
    """``LoRAQKVLinear`` and ``LoRALinear`` with ``lora_dropout=0.1``: the folded dropout's mask, rebuilt from its
    seed, is one a stock dropout could have drawn; outputs and every gradient as stock's with that mask."""
    x = zoo.tokens()
    torch.manual_seed(0)
    stock = zoo.litgpt_model("Llama-2-7b-hf", lora=True, lora_dropout=0.1)
    for p in stock.parameters():
        if p.requires_grad:
            nn.init.normal_(p, std=0.02)
    model = copy.deepcopy(stock)
    report = apply_lowmem(model, example_input=x)
    ours, theirs = (m.transformer.h[0].get_submodule(layer) for m in (model, stock))
    assert isinstance(ours.lora_dropout, nn.Identity) and lora_forward_of(ours).dropout == 0.1
    assert "folded into lora_A (p=0.1)" in next(
        e.detail for e in report.entries if e.name.endswith(f"{layer}.lora_dropout")
    )
    h = torch.randn(2, 16, ours.linear.in_features, requires_grad=True)
    torch.manual_seed(11)
    out = ours.train()(h)
    torch.manual_seed(11)  # the very seed the folded dropout drew: the mask, rebuilt
    mask = kernels.implementation(CPU).dropout(torch.ones_like(h), 0.1, torch.randint(2**62, (1,)))
    del theirs.lora_dropout  # a function in its place, as LitGPT's own at lora_dropout=0
    theirs.lora_dropout = lambda t: t * mask
    h_stock = h.detach().clone().requires_grad_()
    want = theirs.train()(h_stock)
    torch.testing.assert_close(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(h.grad, h_stock.grad)
    for name in ("lora_A", "lora_B"):
        torch.testing.assert_close(getattr(ours, name).grad, getattr(theirs, name).grad)


def test_partial_qkv_adapters_and_merged_weights_compute_as_stock():
    """``lora_key=False`` (an adapter on q and v only, zero-padded) and LitGPT's own ``merge_lora_weights`` after
    the conversion: the converted model keeps computing what the stock one does."""
    x = zoo.tokens()
    torch.manual_seed(0)
    stock = zoo.litgpt_model("Llama-2-7b-hf", lora=True, lora_key=False)
    for p in stock.parameters():
        if p.requires_grad:
            nn.init.normal_(p, std=0.02)
    model = copy.deepcopy(stock)
    apply_lowmem(model, example_input=x)
    torch.testing.assert_close(model.eval()(x), stock.eval()(x), rtol=1e-5, atol=1e-5)
    lora.merge_lora_weights(model)
    lora.merge_lora_weights(stock)
    assert model.transformer.h[0].attn.qkv.merged
    torch.testing.assert_close(model(x), stock(x), rtol=1e-5, atol=1e-5)


def test_a_converted_litgpt_lora_model_compiles_whole_and_matches_eager():
    x = zoo.tokens()
    torch.manual_seed(0)
    model = zoo.litgpt_model("Llama-2-7b-hf", lora=True)
    apply_lowmem(model, example_input=x)
    assert attention_layout_of(model.transformer.h[0].attn) is not None
    assert isinstance(model.transformer.h[0].mlp.fc_1.forward, LoRAForward)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), model(x))


def test_lowmem_bp_converts_a_litgpt_model_in_a_lightning_module_without_an_example(tmp_path):
    import lightning as L

    from lightning_lowmem import LowMemBP

    class LitLoRA(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = zoo.litgpt_model("pythia-160m", lora=True, lora_dropout=0.05)

        def training_step(self, batch, batch_idx):
            logits = self.model(batch[:, :-1])
            return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    data = torch.utils.data.DataLoader(torch.randint(0, zoo.VOCAB, (8, 17)), batch_size=4)
    module, callback = LitLoRA(), LowMemBP()
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", callbacks=[callback], default_root_dir=tmp_path, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data)
    report = callback.report
    assert not report.pending and report.reduction > 0.3, report
    assert lora_forward_of(module.model.transformer.h[0].attn.qkv) is not None
