"""What fits a memory budget: ``max_sequence_length`` / ``training_memory`` predict the step's bytes, and the
prediction holds when the model is measured at the predicted length; ``benchmarks/real_scale.py`` runs."""

from __future__ import annotations

import copy
import runpy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks import zoo
from lightning_lowmem import TrainingMemory, apply_lowmem, max_sequence_length, training_memory
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.surgery.training_memory import GIB, state_bytes, step_peak, with_length

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

TOLERANCE = 0.01  # the predicted length is the longest that fits, to within 1% of it (exact in these cases)


def lora_llama(attention: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    model = zoo.llama(attn_implementation=attention, max_position_embeddings=4096)
    return zoo.lora(model, zoo.LLAMA_LINEARS, r=8, lora_dropout=0.05)


def tokens(length: int = 16) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def step_bytes(model: nn.Module, example: dict, length: int, optimizer_bytes: int = 8) -> int:
    """Weights, gradients and AdamW state counted, plus the measured peak of a training step at ``length`` (what the
    forward saves, and what the backward holds beyond it)."""
    peak = step_peak(model, with_length(example, length))
    tensors = (*model.parameters(), *model.buffers())
    weights = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    trained = [p for p in model.parameters() if p.requires_grad]
    return (
        weights
        + sum(p.numel() * p.element_size() for p in trained)
        + optimizer_bytes * sum(p.numel() for p in trained)
        + peak
    )


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_predicted_length_is_the_longest_that_fits_when_measured(attention):
    model, example = lora_llama(attention), tokens()
    budget_gib = 0.005
    structure = repr(model)
    length = max_sequence_length(model, example, budget_gib)
    assert repr(model) == structure and not any("forward" in vars(m) for m in model.modules())  # unchanged
    converted = copy.deepcopy(model)
    apply_lowmem(converted, example_input=example, verify=False, measure=False)
    assert 100 < length and step_bytes(converted, example, length) <= budget_gib * GIB
    assert step_bytes(converted, example, length + 1 + int(TOLERANCE * length)) > budget_gib * GIB


def test_eager_attention_adds_a_quadratic_term_and_the_stock_model_fits_a_shorter_sequence():
    model, example = lora_llama("eager"), tokens()
    stock = training_memory(model, example, lowmem=False)
    ours = training_memory(model, example)
    assert (stock.weights, stock.gradients, stock.optimizer) == (ours.weights, ours.gradients, ours.optimizer)
    # 2 rows x 4 heads x 2 layers of fp32 softmax output per token pair: the attention is not converted
    assert stock.quadratic == ours.quadratic == 2 * 4 * 2 * 4
    assert 0 < ours.linear < 0.7 * stock.linear
    assert 0 < stock.max_length(0.005 * GIB) < ours.max_length(0.005 * GIB)
    converted = copy.deepcopy(model)
    apply_lowmem(converted, example_input=example, verify=False, measure=False)
    for length in (40, 333):  # the saved bytes' fit holds away from the two measured lengths (16 and 33)
        with SavedTensorMeter(converted) as meter:
            converted.train()(**with_length(example, length))
        assert abs(ours.activation_bytes(length) - meter.total_bytes) <= 64, length
    # the backward's peak is a maximum of terms: near the measured lengths the fit holds; at 333 tokens one layer's
    # fp32 scores' gradient (2 x 4 heads x T^2 x 4 B) has taken over, which max_sequence_length's measurement catches
    measured = step_bytes(converted, example, 40)
    assert abs(ours.bytes_at(40) - measured) <= 0.1 * measured


def test_the_step_peak_is_predicted_at_lengths_far_from_the_measured_ones():
    """SDPA (no term in the length's square): the whole step's peak, forward's saved activations and backward's
    transients, fitted at 16 and 33 tokens, is the measured peak at 100, 333 and 1,000 (within 1%: exact here)."""
    model, example = lora_llama(), tokens()
    memory = training_memory(model, example)
    converted = copy.deepcopy(model)
    apply_lowmem(converted, example_input=example, verify=False, measure=False)
    assert memory.transient_linear > 0 and memory.per_token > memory.linear
    for length in (100, 333, 1000):
        measured = step_bytes(converted, example, length)
        assert abs(memory.bytes_at(length) - measured) <= 0.01 * measured, (length, memory.bytes_at(length), measured)


def test_weights_gradients_and_optimizer_state_are_counted_per_trainable_parameter():
    model = lora_llama()
    params = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trained < sum(p.numel() for p in model.parameters())
    assert state_bytes(model) == (params, 4 * trained, 8 * trained)  # fp32 LoRA adapters, AdamW's two fp32 moments
    assert state_bytes(model, "paged_adamw_8bit")[2] == 2 * trained
    assert state_bytes(model, "SGD")[2] == 0 and state_bytes(model, 4)[2] == 4 * trained
    memory = TrainingMemory(weights=100, gradients=10, optimizer=20, linear=10.0, quadratic=1.0)
    assert memory.max_length(130 + 10 * 5 + 25) == 5 and memory.max_length(130 + 10 * 5 + 24) == 4
    assert memory.max_length(130) == 0


def test_bad_input_gets_a_clear_error():
    model, example = lora_llama(), tokens()
    for bad in (0, -1.0, "1GB", True):
        with pytest.raises(ValueError, match="budget_gib must be a positive number"):
            max_sequence_length(model, example, bad)
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        max_sequence_length(model, example, 1.0, optimizer="lion")
    with pytest.raises(ValueError, match="share their sequence length"):
        max_sequence_length(model, {"input_ids": example["input_ids"], "labels": example["labels"][:, :8]}, 1.0)
    with pytest.raises(ValueError, match="share their sequence length"):
        max_sequence_length(nn.Linear(4, 4), torch.randn(4), 1.0)
    with pytest.raises(ValueError, match="not even one token fits 1e-05 GiB"):
        max_sequence_length(model, example, 1e-5)
    with pytest.raises(TypeError, match="unknown option 'gated_mlp'"):
        max_sequence_length(model, example, 1.0, gated_mlp=False)


def test_the_real_scale_benchmark_runs_and_leaves_results_alone(monkeypatch, capsys):
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    before = (benchmarks / "RESULTS.md").read_text()
    monkeypatch.setattr(sys, "argv", ["real_scale.py", "--smoke"])
    runpy.run_path(str(benchmarks / "real_scale.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "|---" in out and "extrapolated" in out
    assert (benchmarks / "RESULTS.md").read_text() == before


def test_every_rung_of_the_ladder_lowers_the_step_and_the_prediction_holds():
    """Every MLP tiled and every block checkpointed (offloading frees nothing on the host): the step's peak per
    token falls, for the converted model and for the stock one checkpointed, and the fit (64 and 129 tokens) is the
    measured peak at 200, 500 and 1,000 tokens within 10% (measured: 3% over: the peak is a maximum of terms, one
    tile's recompute among them, which a line through two lengths bounds from above)."""
    from lightning_lowmem.surgery.budget import take_every_step
    from lightning_lowmem.surgery.convert import Surgery

    model, example = lora_llama(), tokens(64)
    ours = training_memory(model, example)
    laddered = training_memory(model, example, ladder=("tile", "checkpoint", "offload"))
    stock = training_memory(model, example, lowmem=False)
    checkpointed = training_memory(model, example, lowmem=False, ladder=["checkpoint"])
    assert laddered.per_token < 0.7 * ours.per_token < stock.per_token and checkpointed.per_token < stock.per_token
    assert max_sequence_length(model, example, 0.01, ladder=("tile", "checkpoint")) > max_sequence_length(
        model, example, 0.01
    )
    converted = copy.deepcopy(model)
    apply_lowmem(converted, example_input=example, verify=False, measure=False)
    take_every_step(converted, example, Surgery(converted), ("tile", "checkpoint"))
    for length in (200, 500, 1000):
        measured = step_bytes(converted, example, length)
        assert abs(laddered.bytes_at(length) - measured) <= 0.1 * measured, (
            length,
            laddered.bytes_at(length),
            measured,
        )
    with pytest.raises(ValueError, match="rungs must be some of"):
        training_memory(model, example, ladder=["swap"])
