"""Sharded training: FSDP2, FSDP, DeepSpeed.

FSDP2 (Lightning's ``ModelParallelStrategy``) runs in 2 gloo processes on CPU: the user's ``configure_model``
calls ``fully_shard`` per block, as Lightning documents; ``LowMemBP`` and ``LowMemPrecision`` are added and
nothing else changes. One script runs the stock and the low-memory fit (and one converted on
``example_input_array``) in the same two processes; the tests read what it measured. Lightning runs
``FSDPStrategy`` on GPUs only: here FSDP itself wraps a model with ``LowMemFSDPPrecision``'s config in a
1-process group; the Lightning fit is GPU-marked. DeepSpeed is refused.
"""

from __future__ import annotations

import copy
import math
import re
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import run_ddp_script
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.batchnorm import _BatchNorm

from benchmarks import zoo
from lightning_lowmem import LowMemFSDPPrecision, LowMemPrecision
from lightning_lowmem.lightning import LowMemBP
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.nn import MemorySharingNorm
from lightning_lowmem.surgery import apply_lowmem, plan

timm = pytest.importorskip("timm")


def vit() -> torch.nn.Module:
    return zoo.vit()


def images(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 32, 32, generator=generator), torch.randint(0, 10, (n,), generator=generator)


class ShardedViT(pl.LightningModule):
    """A ViT sharded the documented way; records each training step's saved bytes and the first step's
    gradients (gathered from the shards)."""

    def __init__(self, example: bool = False) -> None:
        super().__init__()
        self.net = vit()
        self.example_input_array = images(2)[0] if example else None
        self.meters: list[SavedTensorMeter] = []
        self.losses: list[float] = []
        self.first_grads: dict[str, torch.Tensor] | None = None

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        with SavedTensorMeter(self) as meter:
            loss = F.cross_entropy(self(batch[0]).float(), batch[1])
        self.meters.append(meter)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.first_grads is None:  # every rank gathers: full_tensor is a collective
            self.first_grads = {
                name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                for name, p in self.named_parameters()
            }

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


FSDP2_SCRIPT = """
import copy, json, torch
import lightning.pytorch as pl
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset
from test_fsdp import ShardedViT, images, vit
from lightning_lowmem import LowMemPrecision
from lightning_lowmem.lightning import LowMemBP
from lightning_lowmem.surgery import apply_lowmem

def fit(model, lowmem):
    callback = LowMemBP()
    extra = dict(callbacks=[callback], plugins=[LowMemPrecision("bf16-mixed")]) if lowmem else dict(precision="bf16-mixed")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(2, 1, save_distributed_checkpoint=False),
                         max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir={root!r}, **extra)
    trainer.fit(model, DataLoader(TensorDataset(*images()), batch_size=4))  # 4 images a rank
    return trainer, callback.report

def measured(model, report=None):
    meter = model.meters[-1]
    return {{"bytes": meter.activation_bytes, "weight_copies": meter.weight_copy_bytes, "losses": model.losses,
             "entries": report and [[e.name, e.kind, e.status] for e in report.entries]}}

torch.manual_seed(0)
stock = ShardedViT()
fit(stock, lowmem=False)
torch.manual_seed(0)
model = ShardedViT()
initial = copy.deepcopy(model.net.state_dict())
trainer, report = fit(model, lowmem=True)
trainer.save_checkpoint({root!r} + "/fsdp2.ckpt")
x = images()[0]
model.eval()
with torch.no_grad():
    trained = model(x)  # every rank: the sharded forward gathers
example = ShardedViT(example=True)
_, example_report = fit(example, lowmem=True)

if trainer.global_rank == 0:
    # one process, no sharding: the same method on both ranks' images at once
    reference = vit()
    reference.load_state_dict(initial)
    plugin = LowMemPrecision("bf16-mixed")
    plugin.convert_module(reference)
    inputs, labels = images()
    with plugin.forward_context():
        apply_lowmem(reference, example_input=inputs)
        F.cross_entropy(reference(inputs).float(), labels).backward()
    errors = {{name: ((model.first_grads["net." + name] - p.grad).norm() / p.grad.norm()).item()
              for name, p in reference.named_parameters()}}
    # the checkpoint loads strictly into the stock model and computes what the trained sharded model computes
    loaded = vit().eval()
    state = torch.load({root!r} + "/fsdp2.ckpt", weights_only=False)["state_dict"]
    loaded.load_state_dict({{k.removeprefix("net."): v for k, v in state.items()}})
    with torch.no_grad():
        checkpoint_error = ((loaded(x) - trained).abs().max() / trained.abs().max()).item()
    json.dump({{"stock": measured(stock), "lowmem": measured(model, report), "example": measured(example, example_report),
               "grad_errors": errors, "checkpoint_error": checkpoint_error}}, open({out!r}, "w"))
"""


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> dict:
    """What the 2-process FSDP2 script measured (stock fit, low-memory fit, low-memory fit on example_input_array)."""
    return run_ddp_script(tmp_path_factory.mktemp("fsdp2"), FSDP2_SCRIPT)


VIT_ENTRIES = [
    ["net.blocks.0.norm1", "norm"], ["net.blocks.0.norm2", "norm"], ["net.blocks.0.mlp.act", "activation"],
    ["net.blocks.1.norm1", "norm"], ["net.blocks.1.norm2", "norm"], ["net.blocks.1.mlp.act", "activation"],
    ["net.norm", "norm"],
]  # fmt: skip


@pytest.mark.parametrize("run", ["lowmem", "example"], ids=["first_batch", "example_input_array"])
def test_fsdp2_converts_every_activation_and_norm(fsdp2, run):
    """Converted after the user's fully_shard: at the first training forward, or right after configure_model."""
    assert fsdp2[run]["entries"] == [[name, kind, "converted"] for name, kind in VIT_ENTRIES]
    assert len(fsdp2[run]["losses"]) == 2 and all(map(math.isfinite, fsdp2[run]["losses"]))


def test_fsdp2_saves_fewer_activation_bytes(fsdp2):
    """A training step's activation bytes (autocast's weight copies aside), low-memory vs stock, same strategy."""
    stock, lowmem = fsdp2["stock"]["bytes"], fsdp2["lowmem"]["bytes"]
    assert lowmem <= 0.7 * stock, (lowmem, stock)
    assert fsdp2["example"]["bytes"] == lowmem


def test_fsdp2_meter_counts_as_without_sharding(fsdp2):
    """SavedTensorMeter under FSDP2 (sharded DTensor parameters, gathered ones in the forward) counts what it
    counts on the same model unsharded: activations, and autocast's weight copies apart."""
    model, (inputs, labels) = vit(), images(4)
    with torch.autocast("cpu", dtype=torch.bfloat16), SavedTensorMeter(model) as meter:
        F.cross_entropy(model(inputs).float(), labels)
    assert meter.weight_copy_bytes > 0
    assert (fsdp2["stock"]["bytes"], fsdp2["stock"]["weight_copies"]) == (
        meter.activation_bytes,
        meter.weight_copy_bytes,
    )


def test_fsdp2_gradients_match_one_process(fsdp2):
    """The gradients FSDP2 reduce-scattered (averaged over the ranks) equal one process's on both ranks' batches."""
    errors = fsdp2["grad_errors"]
    assert len(errors) == len(list(vit().parameters()))
    assert max(errors.values()) < 2e-2, errors


def test_fsdp2_checkpoint_loads_into_the_stock_model(fsdp2):
    assert fsdp2["checkpoint_error"] < 1e-5


@pytest.fixture
def one_process_group():
    """A 1-process gloo group, for FSDP and FSDP2 in this process (FSDP1 runs on CPU without Lightning)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Block(torch.nn.Module):
    """A pre-norm block whose first norm feeds a linear (converted) and whose second feeds an add (stays stock)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm, self.fc, self.act, self.out_norm = (
            nn.LayerNorm(dim),
            nn.Linear(dim, dim),
            nn.GELU(),
            nn.LayerNorm(dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_norm(self.act(self.fc(self.norm(x)))) + x


def converted_blocks() -> tuple[nn.Module, torch.Tensor]:
    model, x = nn.Sequential(Block(), Block()), torch.randn(4, 16)
    report = apply_lowmem(model, example_input=x)
    assert {e.name for e in report.converted} == {"0.norm", "0.act", "1.norm", "1.act"}
    return model, x


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_fsdp1_runs_stock_norms_in_fp32_units(one_process_group, precision):
    """FSDP (FSDP1) on CPU with the plugin's config: stock norms are units of their own computing with fp32
    parameters, the rest (memory-sharing norms included) computes with bf16 ones; forward and backward run."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model, x = converted_blocks()
    plugin = LowMemFSDPPrecision(precision)
    plugin.convert_module(model)
    config = plugin.mixed_precision_config
    assert plugin.norm_classes == (nn.LayerNorm,) and set(config._module_classes_to_ignore) == {
        _BatchNorm,
        nn.LayerNorm,
    }
    assert config.param_dtype == torch.bfloat16
    wrapped = FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=config, use_orig_params=True,
        device_id=torch.device("cpu"),
    )  # fmt: skip
    seen = {}
    for name in ("0.norm", "0.fc", "0.out_norm"):
        module = model.get_submodule(name)
        module.register_forward_hook(lambda m, args, out, name=name: seen.update({name: (m.weight.dtype, out.dtype)}))
    with plugin.forward_context():
        out = wrapped(x.to(plugin._desired_input_dtype))
    out.float().square().sum().backward()
    half = torch.bfloat16
    assert seen == {"0.norm": (half, half), "0.fc": (half, half), "0.out_norm": (torch.float32, half)}
    assert isinstance(model[0].out_norm, FullyShardedDataParallel) and isinstance(model[0].norm, MemorySharingNorm)
    assert all(p.grad is not None and p.grad.isfinite().all() for p in wrapped.parameters())


def test_fsdp1_needs_an_auto_wrap_policy_for_stock_norms():
    """FSDP splits the norms off only while auto-wrapping: setup says so when the strategy has no policy."""
    model = Attached(FSDPStrategy())
    with pytest.raises(MisconfigurationException, match=r"2 stock norms \(LayerNorm\).*auto_wrap_policy"):
        LowMemFSDPPrecision("bf16-mixed").convert_module(model)
    LowMemFSDPPrecision("bf16-mixed").convert_module(Attached(FSDPStrategy(auto_wrap_policy={nn.Sequential})))
    LowMemFSDPPrecision("32-true").convert_module(model)  # nothing to split off in fp32


def test_fsdp_strategy_accepts_the_fsdp_plugin():
    strategy = FSDPStrategy()
    strategy.precision_plugin = plugin = LowMemFSDPPrecision("bf16-mixed")
    assert strategy.mixed_precision_config == plugin.mixed_precision_config
    assert LowMemFSDPPrecision("16-mixed").scaler is not None and repr(plugin) == "LowMemFSDPPrecision('bf16-mixed')"


def test_lowmem_bp_under_fsdp1_needs_example_input_array():
    """FSDP flattens the parameters when it wraps the model: the conversion cannot wait for the first batch."""
    model, callback = Attached(FSDPStrategy(auto_wrap_policy={nn.Sequential})), LowMemBP()
    callback.setup(model._trainer, model, "fit")
    with pytest.raises(MisconfigurationException, match="example_input_array.*ModelParallelStrategy"):
        model.configure_model()


@pytest.mark.parametrize("stage", [2, 3])
def test_lowmem_bp_under_deepspeed_waits_for_the_first_batch_and_refuses_a_zero3_budget(stage):
    """Without ``example_input_array`` the conversion waits for the first batch under every stage (under ZeRO-3 the
    partitioned model is made whole for it: ``test_deepspeed.py``); a budget, fitted inside ZeRO-3's engine, is
    refused there. DeepSpeed's precision stays: the precision plugins refuse it. (Lightning's class imports without
    the deepspeed package; its __init__ needs it.)"""
    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    strategy.config = {"zero_optimization": {"stage": stage}}
    model, callback = Attached(strategy), LowMemBP()
    callback.setup(model._trainer, model, "fit")
    model.configure_model()
    assert callback.report.pending
    budgeted, callback = Attached(strategy), LowMemBP(budget_mib=100)
    callback.setup(budgeted._trainer, budgeted, "fit")
    if stage == 3:
        with pytest.raises(MisconfigurationException, match="ZeRO-3 takes no budget_mib"):
            budgeted.configure_model()
    else:
        budgeted.configure_model()
    for plugin in (LowMemPrecision("bf16-mixed"), LowMemPrecision("bf16-true"), LowMemFSDPPrecision("bf16-mixed")):
        with pytest.raises(MisconfigurationException, match=rf"{re.escape(repr(plugin))} does not support DeepSpeed"):
            plugin.convert_module(model)


def test_true_half_is_refused_under_fsdp2(one_process_group):
    """FSDP2 shards a module's parameters in one dtype: fp32 norms beside bf16 layers cannot be sharded together."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(nn.Sequential(Block(), Block()), mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(MisconfigurationException, match=r"one dtype; use LowMemPrecision\('bf16-mixed'\)"):
        LowMemPrecision("bf16-true").convert_module(model)


def test_fsdp2_state_dict_hooks_follow_the_replaced_modules(one_process_group):
    """FSDP2 reshards a group before state_dict() (the root stays gathered after its forward) by hooks on the
    modules holding its parameters: after the surgery replaced all of them, the hooks are on the new ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, x = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)), torch.randn(4, 16)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), reshard_after_forward=False)

    def sharded_state_dict() -> bool:
        with torch.no_grad():
            model(x)  # leaves the parameters gathered (a backward would reshard them)
        return all(isinstance(value, DTensor) for value in model.state_dict().values())

    plan(model, x)  # converts (its forwards run FSDP2's lazy init, which hooks the stock modules) and rolls back
    assert isinstance(model[0], nn.LayerNorm) and sharded_state_dict()
    report = apply_lowmem(model, example_input=x)
    assert [(e.name, e.status) for e in report.entries] == [("0", "converted")] and sharded_state_dict()


class NormToThree(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm, self.q, self.k, self.v = (
            nn.LayerNorm(dim),
            nn.Linear(dim, dim),
            nn.Linear(dim, dim),
            nn.Linear(dim, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.norm(x)
        return self.q(a) + self.k(a) + self.v(a)


def test_fsdp2_stock_norm_output_is_shared(one_process_group, recorder):
    """LowMemPrecision on an FSDP2 model, stock norm: fp32 parameters, output in the autocast dtype, one tensor
    saved by its three consumer linears (not a half copy each)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, x = NormToThree(), torch.randn(4, 16)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    plugin = LowMemPrecision("bf16-mixed")
    plugin.convert_module(model)
    with plugin.forward_context(), recorder() as record:
        model(x)
    inputs = {t.untyped_storage().data_ptr() for t in record.saved if t.shape == x.shape and t.dtype == torch.bfloat16}
    assert len(inputs) == 1 and model.norm.weight.dtype == torch.float32


def test_fsdp2_replacement_must_hold_the_parameters(one_process_group):
    """FSDP2 would gather into the replacement parameters it does not hold: the surgery refuses such a swap."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_lowmem.surgery.convert import Surgery

    model = fully_shard(nn.Sequential(nn.Linear(4, 4)), mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(RuntimeError, match="Linear does not hold Linear's parameter 'weight'"):
        Surgery(model).replace(model[0], nn.Linear(4, 4))


class Attached(pl.LightningModule):
    """Two stock norms, attached to a stand-in Trainer holding ``strategy`` (what the plugins and the callback
    read at setup), for strategies that cannot run here."""

    def __init__(self, strategy) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8))
        self._trainer = SimpleNamespace(strategy=strategy, callbacks=[])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_fsdp1_trains_on_gpu(tmp_path):
    """A real FSDPStrategy fit (Lightning runs FSDP on GPUs only): converted on example_input_array, then wrapped."""
    model = FSDPViT()
    callback = LowMemBP()
    trainer = pl.Trainer(
        accelerator="cuda", devices=1, strategy=FSDPStrategy(auto_wrap_policy={type(model.net.blocks[0])}),
        plugins=[LowMemFSDPPrecision("bf16-mixed")], callbacks=[callback], max_steps=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*images()), batch_size=4))
    assert [e.status for e in callback.report.entries] == ["converted"] * len(VIT_ENTRIES)
    assert len(model.losses) == 2 and all(map(math.isfinite, model.losses))


class FSDPViT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = vit()
        self.example_input_array = images(2)[0]
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]).float(), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("head", ["frozen, in the root's group", "trained, sharded on its own"])
def test_fsdp2_fuses_the_loss_of_a_causal_lm_whose_head_it_shards(one_process_group, head):
    """The fused loss runs inside the head's own call, where FSDP2 has gathered its weight: the same loss and
    gradients as the unsharded stock model, and no logits."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    stock = zoo.llama()
    stock.lm_head.weight.requires_grad_(head.startswith("trained"))
    model, mesh = copy.deepcopy(stock), init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if head.startswith("trained"):
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = torch.randint(0, stock.config.vocab_size, (2, 64))  # rows enough that a trained fused head saves
    report = apply_lowmem(model, example_input={"input_ids": ids, "labels": ids}, activation=False)
    heads = [e for e in report.entries if e.kind == "head"]
    assert [e.status for e in heads] == ["converted"], heads
    model.zero_grad(set_to_none=True)
    output, want = model(input_ids=ids, labels=ids), stock(input_ids=ids, labels=ids)
    output.loss.backward()
    want.loss.backward()
    assert output.logits is None
    torch.testing.assert_close(output.loss, want.loss)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == {n for n, p in stock.named_parameters() if p.grad is not None}
    for name, grad in grads.items():
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        torch.testing.assert_close(full, stock.get_parameter(name).grad, msg=name)


FSDP2_LLAMA_SCRIPT = """
import json, os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from benchmarks import zoo
from lightning_lowmem import apply_lowmem


def run(rank):
    dist.init_process_group("gloo", init_method="file://{root}/store", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = zoo.llama()
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    report = apply_lowmem(model, example_input={{"input_ids": ids, "labels": ids}})
    if rank == 0:
        entries = [[e.name, e.kind, e.status, e.detail] for e in report.entries]
        json.dump({{"entries": entries, "reduction": report.reduction}}, open({out!r}, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.start_processes(run, nprocs=2, start_method="spawn")
"""


def test_fsdp2_sharded_blocks_convert_as_in_one_process(tmp_path):
    """Each decoder layer under fully_shard in 2 gloo ranks: the gated MLPs are probed with their parameters whole
    (inside FSDP2's unshard), so the report is the one-process model's, gated MLPs fused."""
    sharded = run_ddp_script(tmp_path, FSDP2_LLAMA_SCRIPT)
    torch.manual_seed(0)
    model = zoo.llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    report = apply_lowmem(model, example_input={"input_ids": ids, "labels": ids})
    assert sharded["entries"] == [[e.name, e.kind, e.status, e.detail] for e in report.entries]
    assert [e[2] for e in sharded["entries"] if e[1] == "gated MLP"] == ["converted", "converted"]
