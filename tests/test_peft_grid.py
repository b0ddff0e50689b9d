"""peft's and transformers' own tests of LoRA in half precision, ported to converted models (their tolerances).

- peft ``tests/test_custom_models.py``: ``test_forward_float16`` / ``test_forward_bfloat16`` and their
  ``_no_autocast`` twins: a half-precision base with LoRA (adapters autocast to fp32, or kept in the base's dtype)
  runs forward, merged (safe and not), unmerged and merged-and-unloaded without error; here on a converted model,
  each output also the stock model's.
- peft ``tests/testing_common.py::_test_merge_layers``: the logits unmerged, merged and merged-and-unloaded agree
  (atol = rtol = 1e-4 in fp32).
- transformers ``tests/test_modeling_common.py::test_training_gradient_checkpointing``: with gradient checkpointing
  every trainable parameter gets a gradient; here also, with and without it, gradients as close as stock's are.
"""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks import zoo
from lightning_lowmem import apply_lowmem

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
IDS = torch.randint(0, zoo.VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
HALF_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}  # the same ops on the same bits: rounding order only


def lora_llama(dtype: torch.dtype, autocast_adapter_dtype: bool, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    base = zoo.llama().to(dtype)
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=zoo.LLAMA_LINEARS)
    model = peft.get_peft_model(base, config, autocast_adapter_dtype=autocast_adapter_dtype)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft's init makes B zero: the adapters would add nothing to compare
            torch.nn.init.normal_(param, std=0.02)
    return model


def peft_forward_sequence(model: torch.nn.Module) -> list[torch.Tensor]:
    """peft's ``test_forward_float16``: forward, merged unsafely, unmerged, merged safely, unmerged, unloaded."""
    model.eval()
    logits = [model(input_ids=IDS).logits]
    for safe in (False, True):
        model.merge_adapter(safe_merge=safe)
        logits.append(model(input_ids=IDS).logits)
        model.unmerge_adapter()
        logits.append(model(input_ids=IDS).logits)
    logits.append(model.merge_and_unload()(input_ids=IDS).logits)
    return logits


@pytest.mark.parametrize("autocast_adapter_dtype", [True, False], ids=["", "no_autocast"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_forward_in_half_precision_merged_unmerged_and_unloaded(dtype, autocast_adapter_dtype):
    stock = lora_llama(dtype, autocast_adapter_dtype, dropout=0.05)
    model = copy.deepcopy(stock)
    report = apply_lowmem(model, example_input={"input_ids": IDS, "labels": IDS})
    assert report.converted
    for ours, theirs in zip(peft_forward_sequence(model), peft_forward_sequence(stock), strict=True):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, theirs, rtol=HALF_TOLERANCE[dtype], atol=HALF_TOLERANCE[dtype])


def test_merge_layers_agree_within_peft_tolerance():
    model = lora_llama(torch.float32, True)
    apply_lowmem(model, example_input={"input_ids": IDS, "labels": IDS})
    logits, merged, unmerged, safely_merged, _, unloaded = peft_forward_sequence(model)
    for other in (merged, unmerged, safely_merged, unloaded):
        assert torch.allclose(logits, other, atol=1e-4, rtol=1e-4)


def checkpointing_differences(model: torch.nn.Module) -> dict[str, float]:
    """Each trainable parameter's gradient with gradient checkpointing against without it (relative norm of the
    difference), asserting that every one gets a gradient (transformers' ``test_training_gradient_checkpointing``)."""
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train().zero_grad(set_to_none=True)
        torch.manual_seed(1)
        model(input_ids=IDS, labels=IDS).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    for name, grad in grads[1].items():
        assert grad is not None, f"{name} has no gradient under gradient checkpointing"
    return {name: ((grad - grads[0][name]).norm() / grads[0][name].norm()).item() for name, grad in grads[1].items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_gradient_checkpointing_gives_every_trainable_parameter_its_gradient(dtype):
    """The same gradients with and without checkpointing (dropout masks replayed), as close as stock's are: in bf16,
    transformers 4.57 rounds its recompute differently (stock's own gradients then differ by 0.6%)."""
    stock = lora_llama(dtype, True, dropout=0.05)
    model = copy.deepcopy(stock)
    apply_lowmem(model, example_input={"input_ids": IDS, "labels": IDS})
    ours, theirs = checkpointing_differences(model), checkpointing_differences(stock)
    for name, difference in ours.items():
        assert difference <= 2 * theirs[name] + 1e-6, (name, difference, theirs[name])
