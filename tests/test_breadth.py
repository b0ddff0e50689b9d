"""Converted = stock in training, across the breadth of the two libraries (a sample of ``python -m benchmarks.zoo``,
whose whole sweep is in RESULTS.md): the model types whose loss is not transformers' standard one (labels as given,
scaled logits, two-step predictions), Mamba-2 hybrids' gated norms, and timm's composite norms and BatchNorm convnets,
each tiny and random-init, with and without peft LoRA. Every one is held to the stock copy by
:func:`benchmarks.zoo.check_conversion`: eval outputs, the training loss and gradients, strict loads both ways, every
candidate reported; and the verify stage is shown to catch a head that computes something else.
"""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks import zoo
from lightning_lowmem import apply_lowmem
from lightning_lowmem.nn.causal_lm import LossSemantics, fused_loss_of

pytest.importorskip("transformers")
pytest.importorskip("peft")

UNSHIFTED = ["bart", "blenderbot-small", "whisper", "xlm", "xlnet", "cpmant", "trocr", "prophetnet"]
SCALED = ["cohere", "cohere2"]
GATED_NORMS = ["bamba", "granitemoehybrid", "nemotron_h"]
STANDARD = ["llama", "gemma2", "gpt2"]


def _causal_lm(model_type: str, adapters: bool):
    try:
        model, example = zoo.tiny_hf(model_type, "causal-lm")
    except Exception as err:  # noqa: BLE001 - this library version may lack the type
        pytest.skip(f"{model_type} does not build tiny here: {err}")
    if adapters:
        try:
            model = zoo.lora(model, "all-linear", r=8, lora_alpha=16, lora_dropout=0.05)
        except ValueError as err:  # peft refuses some (Mamba's out_proj)
            pytest.skip(f"peft does not adapt {model_type}: {err}")
    return model, example


CASES = [(t, False) for t in UNSHIFTED + SCALED + GATED_NORMS + STANDARD] + [
    (t, True) for t in UNSHIFTED + SCALED + STANDARD[1:]
]  # LoRA where the heads' semantics are in play (peft's grid: tests/test_peft_grid.py)


@pytest.mark.parametrize(("model_type", "adapters"), CASES, ids=[f"{t}-{'lora' if a else 'stock'}" for t, a in CASES])
def test_causal_lms_train_as_stock(model_type, adapters):
    model, example = _causal_lm(model_type, adapters)
    outcome = zoo.check_conversion(model, example)
    assert outcome.status == "exact", outcome.problems
    if model_type in UNSHIFTED[:-1] + SCALED + STANDARD:
        assert outcome.head.startswith("converted") or "saves" in outcome.head, outcome.head  # or it costs memory
    if model_type == "prophetnet":  # two predictions per position: its head stays, with the reason
        assert outcome.head.startswith("left alone") and "fused loss" in outcome.head, outcome.head


@pytest.mark.parametrize("model_type", ["bart", "cohere"])
def test_head_semantics_are_found_by_computing_the_loss(model_type):
    model, example = _causal_lm(model_type, adapters=True)
    apply_lowmem(model, example_input=example, measure=False)
    (fused,) = [f for m in model.modules() if (f := fused_loss_of(m)) is not None]
    expected = LossSemantics(shift=False) if model_type == "bart" else LossSemantics(scale=model.config.logit_scale)
    assert fused.semantics == expected


@pytest.mark.parametrize("wrong", ["no shift", "no scale"])
def test_verify_rolls_back_a_head_that_computes_something_else(monkeypatch, wrong):
    """A head whose semantics are wrong (as a name-based decision had them) is caught by the training check and
    rolled back alone, with its figures; the rest stays converted."""
    from lightning_lowmem.surgery.families import heads

    model_type = "llama" if wrong == "no shift" else "cohere"
    model, example = _causal_lm(model_type, adapters=True)
    stock = copy.deepcopy(model)
    bad = LossSemantics(shift=False) if wrong == "no shift" else LossSemantics()
    monkeypatch.setattr(heads, "loss_semantics", lambda *args: bad)
    report = apply_lowmem(model, example_input=example, measure=False)
    (head,) = [e for e in report.entries if e.kind == "head"]
    assert head.status == "left alone" and "differs from stock's" in head.detail, head.detail
    assert "vs stock's" in head.detail or "off stock's" in head.detail  # the loss's or a gradient's figures
    assert all(fused_loss_of(m) is None for m in model.modules())
    assert any(e.status == "converted" for e in report.entries if e.kind != "head")
    with torch.no_grad():
        assert torch.allclose(model(**example).loss, stock(**example).loss, rtol=1e-5)


@pytest.mark.parametrize(
    "model_name",
    ["vitamin_small_224", "efficientnet_b0", "convnext_atto", "vit_tiny_patch16_224", "convit_tiny", "nest_tiny"],
)
def test_timm_models_train_as_stock(model_name):
    """ConViT makes a buffer in its forward (the probes once broadcast its old values over it); NesT's max-pools flip
    their argmax on rounding-level differences, stock against stock too (the check allows for that, measured)."""
    pytest.importorskip("timm")
    model, example = zoo.tiny_timm(model_name)
    outcome = zoo.check_conversion(model, example)
    assert outcome.status == "exact", outcome.problems


def test_k_bit_activations_whose_error_compounds_through_a_convnet_are_rolled_back():
    """EfficientNet's SiLUs follow BatchNorms: the 2-bit backward's error grows block by block (thousands of percent
    at initialisation), past the verify stage's limit: its activations stay stock, with the figure; a ViT's stay
    converted, their error in the report."""
    from lightning_lowmem.surgery.verify import APPROXIMATION_LIMIT

    pytest.importorskip("timm")
    model, example = zoo.tiny_timm("efficientnet_b0")
    report = apply_lowmem(model, example_input=example, measure=False)
    activations = [e for e in report.entries if e.kind == "activation"]
    assert activations and all(e.status == "left alone" and "compounds" in e.detail for e in activations)
    assert report.gradient_error is None
    model, example = zoo.tiny_timm("vit_tiny_patch16_224")
    report = apply_lowmem(model, example_input=example, measure=False)
    assert any(e.kind == "activation" and e.status == "converted" for e in report.entries)
    assert 0 < report.gradient_error < APPROXIMATION_LIMIT


def test_a_gradient_that_is_zero_but_for_rounding_is_no_difference():
    """MobileViT's convolution biases before a BatchNorm have gradient 0 (fp64: 1.5e-14) but for rounding (stock's
    6.9e-6, converted 8.4e-6, beside a largest gradient norm of 44): its norms convert, the training step as stock's
    (the training check used to reject them for that noise)."""
    pytest.importorskip("transformers")
    model, example = zoo.tiny_hf("mobilevit", "image-classification")
    report = apply_lowmem(copy.deepcopy(model), example_input=example, measure=False)
    assert sum(e.kind == "norm" and e.status == "converted" for e in report.entries) >= 18
    outcome = zoo.check_conversion(model, example)
    assert outcome.status == "exact", outcome.problems
