"""QLoRA: surgery on a LLaMA-style model quantized by bitsandbytes (frozen nf4 / int8 base) with peft LoRA, on CPU."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from benchmarks import qlora
from benchmarks.qlora import ALL_LINEARS, bf16, held_bytes
from lightning_lowmem.lightning import LowMemBP
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.nn import GatedMLP, MemorySharingNorm
from lightning_lowmem.ops.gated import exception_bytes
from lightning_lowmem.surgery import apply_lowmem, plan

bnb = pytest.importorskip("bitsandbytes", minversion="0.46", reason="QLoRA on CPU needs bitsandbytes >= 0.46")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
_convert_weight_packed_for_cpu = bnb.functional._convert_weight_packed_for_cpu  # the repack bitsandbytes does

LAYERS, HIDDEN, INTERMEDIATE, RANK = 2, 64, 128, 8
PREFIX = "base_model.model.model."


def qlora_llama(tmp_path, bits: int = 4, targets: list[str] = ALL_LINEARS, dropout: float = 0.0) -> nn.Module:
    return qlora.qlora_llama(
        tmp_path, HIDDEN, INTERMEDIATE, heads=4, layers=LAYERS, rank=RANK, bits=bits, targets=targets, dropout=dropout
    )


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16))


def converted(stock: nn.Module, x: torch.Tensor):
    model = copy.deepcopy(stock)
    with bf16():
        report = apply_lowmem(model, example_input=x)
    return model, report


def norm_status(report) -> dict[str, str]:
    return {e.name.removeprefix(PREFIX): e.status for e in report.entries if e.kind == "norm"}


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), bf16():
        return model.eval()(x).logits.float()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def lora_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The LoRA gradients of one training step under bf16 autocast (its loss finite)."""
    model.train()
    model.zero_grad(set_to_none=True)
    with bf16():
        loss = model(x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss)
    return {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}


def linears_4bit(model: nn.Module) -> list[nn.Module]:
    return [layer for layer in model.modules() if isinstance(layer, bnb.nn.Linear4bit)]


def repacked(layer: nn.Module) -> bool:
    return getattr(layer.weight.quant_state, "packing_format_for_cpu", False)


def test_qlora_nf4_converts_norms_fuses_mlps_and_saves_a_quarter_less(tmp_path):
    stock, x = qlora_llama(tmp_path), tokens()
    model, report = converted(stock, x)
    assert set(norm_status(report).values()) == {"converted"}
    assert len(norm_status(report)) == 2 * LAYERS + 1
    assert sum(isinstance(m, MemorySharingNorm) for m in model.modules()) == 2 * LAYERS + 1
    mlp = model.get_submodule(PREFIX + "layers.0.mlp")
    assert isinstance(mlp, GatedMLP) and mlp.resolved_mode() == "gate"  # down_proj's LoRA A saves the product
    assert isinstance(mlp.gate_proj.base_layer, bnb.nn.Linear4bit)  # the quantized layers stay as they are
    torch.testing.assert_close(logits(model, x), logits(stock, x), rtol=1e-2, atol=1e-2 * logits(stock, x).abs().max())

    assert report.saved_bytes_after <= 0.75 * report.saved_bytes_before
    # MatMul4Bit keeps only the quantized weight: SavedTensorMeter sees everything either model holds
    assert held_bytes(model, x) == report.saved_bytes_after
    assert held_bytes(stock, x) == report.saved_bytes_before


def test_qlora_nf4_with_lora_dropout_saves_what_it_saves_without(tmp_path):
    x = tokens()
    without = converted(qlora_llama(tmp_path / "none"), x)[1]
    model, report = converted(qlora_llama(tmp_path / "dropout", dropout=0.05), x)
    assert report.activation_bytes_after <= 1.03 * without.activation_bytes_after
    assert report.activation_bytes_before > 1.1 * without.activation_bytes_before  # stock pays a copy per adapter
    assert model.get_submodule(PREFIX + "layers.0.self_attn.q_proj.lora_A.default").dropout == 0.05


def test_qlora_nf4_saves_what_the_formula_says_outside_attention(tmp_path):
    """Besides the attention core: each norm one bf16 ``z`` and an fp32 rstd per row (its LoRA A adapters and
    frozen 4-bit layers add nothing; layer 0's input norm needs no rstd, its input being the frozen embedding,
    and q_proj's LoRA A saves its ``z``), each MLP its gate and product (and the slots for ``up`` where its activation
    is 0), each LoRA B its r-wide input."""
    stock, x = qlora_llama(tmp_path), tokens()
    model = converted(stock, x)[0]
    model.train()
    with bf16(), SavedTensorMeter(model) as meter:
        model(x)
    rows = x.numel()
    norms = (2 * LAYERS + 1) * (rows * HIDDEN * 2 + rows * 4) - rows * 4
    mlps = LAYERS * (
        2 * rows * INTERMEDIATE * 2 + exception_bytes((rows, INTERMEDIATE), torch.bfloat16)
    )  # + up where act is 0
    lora_b = LAYERS * len(ALL_LINEARS) * rows * RANK * 2
    outside_attention = sum(r.nbytes for r in meter.records if not r.module.endswith("self_attn"))
    assert outside_attention == norms + mlps + lora_b


def test_frozen_4bit_layers_without_lora_are_consumers(tmp_path):
    """LoRA on q and v only: the MLP's norm is read by frozen 4-bit gate and up projections alone; they save
    nothing, so the norm converts and saves its bf16 ``z`` instead of stock RMSNorm's fp32 tensors."""
    stock, x = qlora_llama(tmp_path, targets=["q_proj", "v_proj"]), tokens()
    model, report = converted(stock, x)
    assert norm_status(report)["layers.0.post_attention_layernorm"] == "converted"
    detail = next(e.detail for e in report.entries if e.name == PREFIX + "layers.0.post_attention_layernorm")
    assert "mlp.gate_proj, mlp.up_proj" in detail
    torch.testing.assert_close(logits(model, x), logits(stock, x), rtol=1e-2, atol=1e-2 * logits(stock, x).abs().max())
    assert held_bytes(model, x) <= 0.75 * held_bytes(stock, x)


def test_probes_leave_4bit_weights_as_they_are(tmp_path):
    """On a CPU with AVX512-BF16, bitsandbytes repacks a Linear4bit's weight in place on an eval forward without
    grad (asserting that its output size is a multiple of 32, none is here): forced on, the probe forwards of a
    dry run (``plan``, which leaves the model as it was) must not trigger it."""
    stock = qlora.qlora_llama(tmp_path, 48, 80, heads=4, layers=1, rank=RANK)
    for layer in linears_4bit(stock):
        layer.support_avx512bf16_for_cpu = True
    weights = [layer.weight.clone() for layer in linears_4bit(stock)]
    with bf16():
        report = plan(stock, tokens())
    assert set(norm_status(report).values()) == {"converted"}
    assert [e.status for e in report.entries if e.kind == "gated MLP"] == ["converted"]
    for layer, weight in zip(linears_4bit(stock), weights, strict=True):
        assert layer.support_avx512bf16_for_cpu
        assert not repacked(layer)
        assert torch.equal(layer.weight, weight)


def test_training_after_an_eval_forward_keeps_gradients_through_4bit_layers(tmp_path):
    """After that repack (on an eval forward without grad: Lightning's sanity check, a validation epoch) the layer
    computes through a kernel without autograd, and the layers before it get no gradient through it. Forced on
    (as on such a CPU), the surgery switches it off for good: the LoRA gradients after an eval forward are those
    before it."""
    stock, x = qlora_llama(tmp_path), tokens()
    for layer in linears_4bit(stock):
        layer.support_avx512bf16_for_cpu = True
    model, report = converted(stock, x)
    assert not any(layer.support_avx512bf16_for_cpu for layer in linears_4bit(model))
    assert f"CPU repacking switched off on {7 * LAYERS} 4-bit layers" in report.summary()
    before = lora_grads(model, x)
    logits(model, x)  # eval, no grad: a validation step
    assert not any(repacked(layer) for layer in linears_4bit(model))
    after = lora_grads(model, x)
    for name, grad in before.items():
        torch.testing.assert_close(after[name], grad, msg=name)


def test_weights_repacked_before_the_surgery_are_unpacked(tmp_path):
    """A model that already ran an eval forward holds repacked weights: the surgery unpacks them (as bitsandbytes
    does before saving one), and they dequantize as before, but for block scales the repack rounded to bf16."""
    stock, x = qlora_llama(tmp_path), tokens()
    layer = linears_4bit(stock)[0]
    original = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu(
        layer.weight.data, layer.weight.quant_state
    )
    model, report = converted(stock, x)
    assert not any(repacked(layer) for layer in linears_4bit(model))
    assert "1 4-bit weights repacked by an earlier eval forward unpacked" in report.summary()
    ours = linears_4bit(model)[0]
    restored = bnb.functional.dequantize_4bit(ours.weight.data, ours.weight.quant_state)
    torch.testing.assert_close(restored, original, rtol=2**-8, atol=0)


class QLoRAModule(pl.LightningModule):
    """A QLoRA LLaMA without ``example_input_array``: LowMemBP converts it at the first training batch, after
    Lightning's sanity check has run its validation forwards."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(batch, labels=batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_lightning_sanity_check_leaves_4bit_weights_trainable(tmp_path):
    """The sanity check's eval forwards come before the conversion: the callback switches repacking off at setup."""
    stock = qlora_llama(tmp_path)
    for layer in linears_4bit(stock):
        layer.support_avx512bf16_for_cpu = True
    callback, data = LowMemBP(), DataLoader([tokens()[0] for _ in range(4)], batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, num_sanity_val_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(QLoRAModule(stock), data, data)
    assert not callback.report.pending
    summary = callback.report.summary()
    assert f"CPU repacking switched off on {7 * LAYERS} 4-bit layers" in summary
    assert "unpacked" not in summary  # switched off before the sanity check: nothing was ever repacked
    assert not any(layer.support_avx512bf16_for_cpu or repacked(layer) for layer in linears_4bit(stock))


def test_qlora_trains(tmp_path):
    """A few AdamW steps under bf16 autocast: finite losses, nonzero LoRA gradients close to stock QLoRA's, the
    quantized weights untouched."""
    stock, x = qlora_llama(tmp_path), tokens()
    model = converted(stock, x)[0]
    quantized = model.get_submodule(PREFIX + "layers.0.mlp.up_proj.base_layer").weight.clone()
    ours, reference = lora_grads(model, x), lora_grads(stock, x)
    assert ours.keys() == reference.keys() and len(ours) == 2 * 7 * LAYERS
    for name, grad in ours.items():
        assert grad.abs().sum() > 0, name
        similarity = cosine(grad, reference[name])
        assert similarity > 0.99, (name, similarity)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        with bf16():
            loss = model(x, labels=x).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert torch.equal(model.get_submodule(PREFIX + "layers.0.mlp.up_proj.base_layer").weight, quantized)


def test_int8_qlora_converts_and_holds_less(tmp_path):
    """Linear8bitLt keeps its input as a ``ctx`` attribute (outside saved-tensor hooks): it is no consumer, so
    norms convert through the LoRA A adapters that share, and the count includes what it keeps."""
    stock, x = qlora_llama(tmp_path, bits=8), tokens()
    model, report = converted(stock, x)
    assert set(norm_status(report).values()) == {"converted"}
    assert isinstance(model.get_submodule(PREFIX + "layers.0.mlp"), GatedMLP)
    # int8 computes in fp16 from the bf16 norm output (stock: from fp32): one more bf16 rounding
    torch.testing.assert_close(logits(model, x), logits(stock, x), rtol=2e-2, atol=2e-2 * logits(stock, x).abs().max())
    assert held_bytes(model, x) <= 0.75 * held_bytes(stock, x)
    only_qv = qlora_llama(tmp_path, bits=8, targets=["q_proj", "v_proj"])
    status = norm_status(converted(only_qv, x)[1])
    assert status["layers.0.post_attention_layernorm"] == "left alone"  # read by int8 layers only


def test_the_budget_counts_the_flops_of_4bit_matmuls(tmp_path):
    """bitsandbytes' CPU path is one fused op that torch's FLOP counter does not know: a QLoRA block's recompute
    cost would be its adapters' and attention's alone."""
    from lightning_lowmem.surgery.budget import measure_blocks

    model, x = qlora_llama(tmp_path), tokens()
    block = "base_model.model.model.layers.0"
    base = sum(2 * x.numel() * layer.in_features * layer.out_features for layer in linears_4bit(model)[:7])
    assert all(layer.weight.quant_state is not None for layer in linears_4bit(model))
    with bf16():
        (measured,), _, total = measure_blocks(model, x, [block])
    assert base < measured.flops < 1.5 * base and total > LAYERS * base
