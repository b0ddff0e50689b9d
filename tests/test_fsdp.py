"""Sharded training: FSDP2 (Lightning's ``ModelParallelStrategy``) in 2 gloo processes on CPU.

The user's ``configure_model`` calls ``fully_shard`` per block, as Lightning documents; ``LowMemBP`` and
``LowMemPrecision`` are added and nothing else changes. One script runs the stock and the low-memory fit
(and one converted on ``example_input_array``) in the same two processes; the tests read what it measured.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import run_ddp_script
from torch.distributed.tensor import DTensor

from lightning_lowmem.memory import SavedTensorMeter

timm = pytest.importorskip("timm")


def vit() -> torch.nn.Module:
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, depth=2, img_size=32, patch_size=8, num_classes=10
    )


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
    return {{"bytes": model.meters[-1].activation_bytes, "losses": model.losses,
             "entries": report and [[e.name, e.kind, e.status] for e in report.entries]}}

torch.manual_seed(0)
stock = ShardedViT()
trainer, _ = fit(stock, lowmem=False)
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


def test_fsdp2_gradients_match_one_process(fsdp2):
    """The gradients FSDP2 reduce-scattered (averaged over the ranks) equal one process's on both ranks' batches."""
    errors = fsdp2["grad_errors"]
    assert len(errors) == len(list(vit().parameters()))
    assert max(errors.values()) < 2e-2, errors


def test_fsdp2_checkpoint_loads_into_the_stock_model(fsdp2):
    assert fsdp2["checkpoint_error"] < 1e-5
