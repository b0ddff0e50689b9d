"""Activation-memory budgets: after the low-memory conversion, checkpoint the fewest blocks that fit it."""

from __future__ import annotations

import copy
import json
import pickle

import lightning.pytorch as pl
import pytest
import torch
from conftest import run_ddp_script
from torch import nn

from benchmarks import zoo
from lightning_lowmem import LowMemBP, PeakMemoryMonitor, apply_lowmem, max_batch_size, plan
from lightning_lowmem.lightning import plots
from lightning_lowmem.memory import MIB, SavedTensorMeter
from lightning_lowmem.nn.recompute import checkpointed_forward
from lightning_lowmem.surgery.budget import find_blocks

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")


def vit_small() -> nn.Module:
    torch.manual_seed(0)  # ViT-S's 12 blocks at a small image: the model, quick on a CPU
    return zoo.vit("vit_small_patch16_224", depth=12, img_size=64, patch_size=16)


def images(batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def gradients(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.train().zero_grad(set_to_none=True)
    out = model(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).square().sum().backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def need() -> int:
    """The low-memory model's activation bytes on the example, unbudgeted."""
    return apply_lowmem(vit_small(), example_input=images()).saved_bytes_after


@pytest.mark.parametrize("fraction", [0.6, 0.3])
def test_a_budget_is_met_by_checkpointing_blocks_with_the_same_gradients(need, fraction):
    x = images()
    unbudgeted, model = vit_small(), vit_small()
    apply_lowmem(unbudgeted, example_input=x)
    budget_mib = fraction * need / MIB
    report = apply_lowmem(model, example_input=x, budget_mib=budget_mib)
    budget = report.budget
    assert 0 < len(report.checkpointed) < 12 if fraction == 0.6 else len(report.checkpointed) >= 1
    assert budget.measured_bytes <= budget_mib * MIB and budget.predicted_bytes <= budget_mib * MIB
    with SavedTensorMeter(model) as meter:  # what the wrapped model saves: what the plan measured
        model.train()(x)
    assert meter.total_bytes == budget.forward_bytes < need
    own = {b.name: b.own_bytes for b in budget.blocks}
    assert budget.recompute_bytes == max(own[name] for name in report.checkpointed)
    assert set(report.checkpointed) <= set(find_blocks(model)) and all(
        model.get_submodule(name).forward.func is checkpointed_forward for name in report.checkpointed
    )
    ours, theirs = gradients(model, x), gradients(unbudgeted, x)
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-4 * grad.abs().max().item(), msg=name)
    assert 0 < budget.recompute_fraction < 1 and f"{len(report.checkpointed)} of 12 blocks" in str(report)


def test_a_budget_the_low_memory_model_meets_checkpoints_nothing(need):
    report = apply_lowmem(vit_small(), example_input=images(), budget_mib=need / MIB)
    assert report.checkpointed == [] and report.budget.measured_bytes == need


def test_an_impossible_budget_names_the_smallest_achievable_and_changes_nothing(need):
    model = vit_small()
    structure = repr(model)
    with pytest.raises(ValueError, match=r"checkpointing every block \(12\) still needs [\d.]+ MiB, the smallest"):
        apply_lowmem(model, example_input=images(), budget_mib=0.05 * need / MIB)
    assert repr(model) == structure and "forward" not in vars(model.blocks[0])


def test_plan_predicts_without_changing_the_model(need):
    model = vit_small()
    structure = repr(model)
    planned = plan(model, images(), budget_mib=0.6 * need / MIB)
    assert repr(model) == structure and not any("forward" in vars(m) for m in model.modules())
    applied = apply_lowmem(model, example_input=images(), budget_mib=0.6 * need / MIB)
    assert (
        planned.checkpointed == applied.checkpointed and planned.budget.measured_bytes == applied.budget.measured_bytes
    )


def test_max_batch_size_is_the_largest_batch_that_fits(need):
    model, x = vit_small(), images(4)
    budget_mib = 2.5 * need / MIB
    size = max_batch_size(model, x, budget_mib)
    assert 8 <= size < 16 and not any("forward" in vars(m) for m in model.modules())  # nothing changed
    converted = copy.deepcopy(model)
    apply_lowmem(converted, example_input=x)
    for batch, fits in ((size, True), (size + 1, False)):
        with SavedTensorMeter(converted) as meter:
            converted.train()(images(batch))
        assert (meter.total_bytes <= budget_mib * MIB) is fits, batch


def test_max_batch_size_with_the_ladder_is_the_largest_batch_the_budget_meets(need):
    model, x = vit_small(), images(4)
    budget_mib = need / MIB
    plain = max_batch_size(model, x, budget_mib)
    size = max_batch_size(model, x, budget_mib, ladder="checkpoint")
    assert size > 2 * plain and not any("forward" in vars(m) for m in model.modules())  # nothing changed
    report = apply_lowmem(copy.deepcopy(model), example_input=images(size), budget_mib=budget_mib, rungs="checkpoint")
    assert report.budget.measured_bytes <= budget_mib * MIB
    with pytest.raises(ValueError, match="cannot be met at this batch"):
        apply_lowmem(copy.deepcopy(model), example_input=images(size + 1), budget_mib=budget_mib, rungs="checkpoint")
    with pytest.raises(ValueError, match="rungs must be some of"):
        max_batch_size(model, x, budget_mib, ladder=("recompute",))


def test_a_budgeted_model_keeps_its_state_dict_and_pickles(need):
    model = vit_small()
    keys = list(model.state_dict())
    apply_lowmem(model, example_input=images(), budget_mib=0.6 * need / MIB)
    assert list(model.state_dict()) == keys
    copied = pickle.loads(pickle.dumps(model))
    copied.eval()
    torch.testing.assert_close(copied(images()), model.eval()(images()))
    assert copied.blocks[0].forward.args[0] is copied.blocks[0]  # the copy checkpoints its own block


def test_hugging_face_layers_are_found_and_named_blocks_override():
    model = zoo.llama(num_hidden_layers=3)
    assert find_blocks(model) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert find_blocks(model, ["model.layers.[02]"]) == ["model.layers.0", "model.layers.2"]
    tokens = torch.randint(0, 128, (2, 16))
    need = apply_lowmem(copy.deepcopy(model), example_input=tokens).saved_bytes_after
    # one block alone cannot lower the peak (its recomputation holds its bytes again): name two
    report = apply_lowmem(model, example_input=tokens, budget_mib=0.9 * need / MIB, checkpoint="model.layers.[12]")
    assert report.checkpointed == ["model.layers.1", "model.layers.2"]
    with pytest.raises(ValueError, match="matches no module"):
        apply_lowmem(copy.deepcopy(model), example_input=tokens, budget_mib=1.0, checkpoint="blocks.*")


def test_bad_budgets_are_refused_before_anything_runs():
    for bad in (0, -1.0, "1GB", True):
        with pytest.raises(ValueError, match="budget_mib"):
            apply_lowmem(vit_small(), example_input=images(), budget_mib=bad)


# -- in a Trainer ------------------------------------------------------------------------------
class Blocks(pl.LightningModule):
    """Three pre-norm MLP blocks; ``example_input_array`` has 2 rows, the training batches 8: the budget is
    fitted on the first training batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(Residual(64) for _ in range(3)))
        self.example_input_array = torch.randn(2, 16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)

    def training_step(self, batch, batch_idx):
        return self(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(
            torch.randn(16, 16, 64, generator=torch.Generator().manual_seed(2)), batch_size=8
        )


class Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


def test_lowmem_bp_fits_the_budget_on_the_first_training_batch_and_the_monitor_shows_the_plan(tmp_path):
    need = apply_lowmem(Blocks(), example_input=torch.randn(8, 16, 64)).saved_bytes_after
    callback, monitor = LowMemBP(budget_mib=0.8 * need / MIB), PeakMemoryMonitor(activation_every_n_steps=1, plot=True)
    pl.Trainer(
        accelerator="cpu", max_epochs=1, default_root_dir=tmp_path, logger=False, callbacks=[callback, monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(Blocks())  # fmt: skip
    plan = callback.report.budget
    assert callback.report.probe == "model(tensor[2, 16, 64])"  # converted on the example ...
    assert plan.measured_bytes <= 0.8 * need and len(plan.checkpointed) == 2  # ... the budget fits batches of 8
    summary = json.loads((tmp_path / "peak_memory.json").read_text())
    measured = summary["epochs"][0]["train"]["activation"] - summary["modules_first_epoch_mib"]["<outside>"]
    assert measured == pytest.approx(summary["lowmem"]["budget"]["forward_mib"], abs=1e-3)  # each step: the plan
    labels = [line.get_label() for line in plots.epoch_figure(summary).axes[0].get_lines()]
    assert f"LowMemBP budget {summary['lowmem']['budget']['budget_mib']:g} MiB" in labels
    assert any(label.startswith("planned: forward") and "2 blocks checkpointed" in label for label in labels)


DDP_SCRIPT = """
import json, torch
import lightning.pytorch as pl
from test_budget import Blocks
from lightning_lowmem import LowMemBP

callback = LowMemBP(budget_mib={budget})
trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_steps=2, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     callbacks=[callback], default_root_dir={root!r})
model = Blocks()
trainer.fit(model)
checkpointed = trainer.strategy.all_gather(torch.tensor([int(n.rpartition(".")[2]) for n in callback.report.checkpointed]))
weights = trainer.strategy.all_gather(torch.cat([p.detach().flatten() for p in model.parameters()]))
if trainer.global_rank == 0:
    json.dump({{"checkpointed": checkpointed.tolist(), "ranks_equal": bool(torch.equal(weights[0], weights[1]))}},
              open({out!r}, "w"))
"""


def test_ddp_ranks_checkpoint_the_same_blocks(tmp_path):
    need = apply_lowmem(Blocks(), example_input=torch.randn(8, 16, 64)).saved_bytes_after
    result = run_ddp_script(tmp_path, DDP_SCRIPT, budget=0.8 * need / MIB)
    assert result == {"checkpointed": [[1, 2], [1, 2]], "ranks_equal": True}


def llama_lora() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The tiny LLaMA (hidden 64: tiles of 64 tokens), LoRA r=4 on every linear, 2 x 256 tokens with labels."""
    torch.manual_seed(0)
    model = zoo.lora(zoo.llama(), zoo.LLAMA_LINEARS, random_b=True)
    ids = torch.randint(0, zoo.VOCAB, (2, 256), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def llama_gradients(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    model.train().zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_the_ladder_tiles_mlps_first_and_each_rung_can_be_left_out():
    model, batch = llama_lora()
    need = plan(model, batch).saved_bytes_after
    unbudgeted = copy.deepcopy(model)
    apply_lowmem(unbudgeted, example_input=batch)
    report = apply_lowmem(model, example_input=batch, budget_mib=0.8 * need / MIB)
    budget = report.budget
    assert budget.tiled == [f"base_model.model.model.layers.{i}.mlp" for i in (0, 1)] and budget.checkpointed == []
    assert budget.measured_bytes <= 0.8 * need and budget.predicted_bytes <= 0.8 * need
    assert budget.tile_tokens == 64 and "2 MLPs tiled (64 tokens a tile)" in budget.summary()
    ours, theirs = llama_gradients(model, batch), llama_gradients(unbudgeted, batch)
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    without_tiles = plan(llama_lora()[0], batch, budget_mib=0.8 * need / MIB, rungs=["checkpoint"]).budget
    assert without_tiles.tiled == [] and without_tiles.checkpointed
    smaller_tiles = plan(llama_lora()[0], batch, budget_mib=0.8 * need / MIB, tile_tokens=32).budget
    assert smaller_tiles.tile_tokens == 32 and "(32 tokens a tile)" in smaller_tiles.summary()
    assert smaller_tiles.recompute_bytes < budget.recompute_bytes  # its backward holds half a tile of 64
    with pytest.raises(ValueError, match=r"rungs must be some of \('tile', 'checkpoint', 'offload'\)"):
        apply_lowmem(model, example_input=batch, rungs=["tile", "swap"])
    with pytest.raises(ValueError, match="tile_tokens must be a positive number of positions, got 0"):
        apply_lowmem(model, example_input=batch, tile_tokens=0)


def test_offload_frees_the_checkpointed_inputs_on_a_device_and_is_never_taken_on_the_host(monkeypatch):
    """On the host (this CPU) offloading frees nothing and is not taken. Here the budget is told the host is
    elsewhere (``HOST`` = meta), so the CPU model counts as on a device: after tiling and checkpointing every block,
    the blocks' inputs go to the host (copies, the device's freed), measured out of what the device keeps, with the
    unbudgeted gradients."""
    from lightning_lowmem.surgery import budget as ladder

    model, batch = llama_lora()
    unbudgeted = copy.deepcopy(model)
    apply_lowmem(unbudgeted, example_input=batch)
    with pytest.raises(ValueError, match=r"still needs ([\d.]+) MiB") as on_host:
        plan(llama_lora()[0], batch, budget_mib=0.01)
    smallest_on_host = float(on_host.value.args[0].split("still needs ")[1].split(" MiB")[0])
    monkeypatch.setattr(ladder, "HOST", torch.device("meta"))
    with pytest.raises(ValueError, match=r"still needs ([\d.]+) MiB") as on_device:
        plan(llama_lora()[0], batch, budget_mib=0.01)
    smallest_offloaded = float(on_device.value.args[0].split("still needs ")[1].split(" MiB")[0])
    assert smallest_offloaded < smallest_on_host
    report = apply_lowmem(model, example_input=batch, budget_mib=(smallest_offloaded + 0.01))
    budget = report.budget
    assert budget.offloaded and set(budget.offloaded) <= set(budget.checkpointed) and budget.moved_bytes > 0
    assert "offloaded" in budget.summary() and budget.measured_bytes <= (smallest_offloaded + 0.01) * MIB
    ours, theirs = llama_gradients(model, batch), llama_gradients(unbudgeted, batch)
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_the_flop_counter_counts_the_cpus_attention_as_torch_counts_cudas(kv_heads):
    """CPU flash attention counted as torch counts CUDA's, grouped-query attention as each query head against its
    group's key and value head (torch before 2.14 refuses it)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    from lightning_lowmem.surgery.flops import flop_counter

    shape, kv_shape = (2, 4, 32, 16), (2, kv_heads, 32, 16)
    q = torch.randn(shape, requires_grad=True)
    k, v = (torch.randn(kv_shape, requires_grad=True) for _ in range(2))
    with flop_counter() as counter:
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads < 4)
    assert counter.get_total_flops() == sdpa_flop_count(shape, shape, shape) > 0
    with flop_counter() as counter:
        out.sum().backward()
    assert counter.get_total_flops() == sdpa_backward_flop_count(shape, shape, shape, shape) > 0
