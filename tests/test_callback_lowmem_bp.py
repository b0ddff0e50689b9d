"""LowMemBP in real Lightning runs: when the surgery happens, checkpoints, repeated runs, DDP."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import run_ddp_script
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import zoo
from lightning_lowmem.lightning import LowMemBP, PeakMemoryMonitor
from lightning_lowmem.nn import GatedMLP, LowMemLinear, MemorySharingNorm

REPO = Path(__file__).resolve().parents[1]
timm = pytest.importorskip("timm")


def block(dim: int = 16) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, 4))


class Module(pl.LightningModule):
    """A tiny pre-norm MLP, built in ``__init__`` or (``late=True``) in ``configure_model``."""

    def __init__(self, late: bool = False, example: bool = True) -> None:
        super().__init__()
        self.late = late
        self.net = None if late else block()
        self.example_input_array = torch.randn(2, 16) if example else None
        self.optimized: list[nn.Parameter] = []
        self.training_steps = 0

    def configure_model(self) -> None:
        if self.net is None:
            self.net = block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.training_steps += 1
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.training_step(batch, batch_idx))

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)

    def configure_optimizers(self):
        if self.example_input_array is not None:
            assert isinstance(self.net[1], LowMemLinear), "optimizers must be created after the surgery"
        self.optimized = list(self.parameters())
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    data = TensorDataset(torch.randn(16, 16), torch.randint(0, 4, (16,)))
    return DataLoader(data, batch_size=4)


def trainer(tmp_path: Path, **kwargs) -> pl.Trainer:
    options = {
        "accelerator": "cpu", "devices": 1, "max_steps": 2, "logger": False, "enable_progress_bar": False,
        "enable_model_summary": False, "default_root_dir": tmp_path, "callbacks": [LowMemBP()],
    }  # fmt: skip
    return pl.Trainer(**{**options, **kwargs})


@pytest.mark.parametrize("late", [False, True], ids=["init", "configure_model"])
def test_converts_before_optimizers_and_prints_once(tmp_path, late, caplog):
    model = Module(late=late)
    t = trainer(tmp_path)
    with caplog.at_level("INFO"):
        t.fit(model, loader(), loader())
    callback = t.callbacks[0] if isinstance(t.callbacks[0], LowMemBP) else None
    report = callback.report
    assert report.status("net.0") == "converted" and report.status("net.2") == "converted"
    assert isinstance(model.net[0], MemorySharingNorm) and model.net[1].norm is model.net[0]
    assert report.saved_bytes_after < report.saved_bytes_before
    assert sum("LowMemBP:" in r.getMessage() for r in caplog.records) == 1
    assert "configure_model" not in model.__dict__  # the hook patch is gone
    # repeated runs: validate/test/fit again change nothing and do not print again
    structure = repr(model)
    t.validate(model, loader())
    t.test(model, loader())
    trainer(tmp_path, callbacks=[callback]).fit(model, loader())
    assert repr(model) == structure and callback.report is report
    assert sum("LowMemBP:" in r.getMessage() for r in caplog.records) == 1


def test_checkpoint_resume_and_stock_load(tmp_path):
    model = Module()
    t = trainer(tmp_path, max_steps=2)
    t.fit(model, loader())
    ckpt = tmp_path / "step2.ckpt"
    t.save_checkpoint(ckpt)
    # the checkpoint loads strictly into the stock architecture and computes the same function
    stock = block()
    stock.load_state_dict({k.removeprefix("net."): v for k, v in torch.load(ckpt)["state_dict"].items()})
    x = torch.randn(3, 16)
    torch.testing.assert_close(stock(x), model.eval()(x))
    # resume through Lightning: weights and optimizer state restored into the converted model
    resumed = Module()
    t2 = trainer(tmp_path, max_steps=4)
    t2.fit(resumed, loader(), ckpt_path=ckpt)
    assert t2.global_step == 4 and isinstance(resumed.net[0], MemorySharingNorm)


DDP_SCRIPT = """
import json, torch
import lightning.pytorch as pl
from test_callback_lowmem_bp import Module, loader
from lightning_lowmem.lightning import LowMemBP
from lightning_lowmem.nn import MemorySharingNorm

callback = LowMemBP()
trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_steps=3, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     callbacks=[callback], default_root_dir={root!r})
torch.manual_seed(0)
model = Module(example={example})
trainer.fit(model, loader())
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = trainer.strategy.all_gather(weights)
if trainer.global_rank == 0:
    json.dump({{"converted": [e.name for e in callback.report.converted],
               "norm": isinstance(model.net[0], MemorySharingNorm),
               "ranks_equal": bool(torch.equal(gathered[0], gathered[1])),
               "steps": trainer.global_step, "training_steps": model.training_steps}}, open({out!r}, "w"))
"""


@pytest.mark.parametrize("example", [True, False], ids=["example_input_array", "first_batch"])
def test_ddp_cpu_two_processes(tmp_path, example):
    """Converted alike on both ranks; at the first batch, the step's own forward is probed, not the call Lightning's
    DDP redirects to ``training_step`` (which the probe would run: a fourth step's side effects)."""
    result = run_ddp_script(tmp_path, DDP_SCRIPT, example=example)
    expected = {"converted": ["net.0", "net.2"], "norm": True, "ranks_equal": True, "steps": 3, "training_steps": 3}
    assert result == expected


class Arch(pl.LightningModule):
    """A real architecture (random init, peft LoRA) trained through Lightning."""

    def __init__(self, arch: str) -> None:
        super().__init__()
        from test_surgery import tiny_llama, tiny_vit

        self.arch = arch
        self.net = tiny_vit(["qkv", "fc1"]) if arch == "vit" else tiny_llama()
        self.example_input_array = zoo.images() if arch == "vit" else zoo.tokens()

    def forward(self, x):
        out = self.net(x)
        return out.logits if hasattr(out, "logits") else out

    def training_step(self, batch, batch_idx):
        return self(batch[0]).float().square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


@pytest.mark.parametrize("arch", ["vit", "llama"])
def test_real_architectures_fit_checkpoint_resume(tmp_path, arch):
    torch.manual_seed(0)
    model = Arch(arch)
    inputs = torch.randn(8, 3, 32, 32) if arch == "vit" else torch.randint(0, 128, (8, 16))
    data = DataLoader(TensorDataset(inputs), batch_size=4)
    t = trainer(tmp_path, precision="bf16-mixed")
    t.fit(model, data)
    report = t.callbacks[0].report
    assert sum(isinstance(m, MemorySharingNorm) for m in model.modules()) == 5  # 2 per block + the final norm
    assert any(isinstance(m, GatedMLP) for m in model.modules()) == (arch == "llama")
    assert report.saved_bytes_after < 0.8 * report.saved_bytes_before
    ckpt = tmp_path / "arch.ckpt"
    t.save_checkpoint(ckpt)
    torch.manual_seed(0)
    stock = Arch(arch)
    stock.load_state_dict(torch.load(ckpt)["state_dict"], strict=True)
    x = model.example_input_array
    torch.testing.assert_close(model.eval()(x), stock.eval()(x), rtol=1e-4, atol=1e-4)
    resumed = Arch(arch)
    t2 = trainer(tmp_path, max_steps=3, precision="bf16-mixed")
    t2.fit(resumed, data, ckpt_path=ckpt)
    assert t2.global_step == 3


class Backbone(pl.LightningModule):
    """A LightningModule that sets no ``example_input_array`` (as most do) and calls its backbone from
    ``training_step``: a timm ViT, or a Hugging Face model fed dict batches."""

    def __init__(self, arch: str) -> None:
        super().__init__()
        from test_surgery import tiny_bert

        self.arch = arch
        if arch == "vit":
            self.model = zoo.vit(num_classes=4, depth=12)
        else:
            self.model = tiny_bert()

    def training_step(self, batch, batch_idx):
        if self.arch == "vit":
            x, y = batch
            return nn.functional.cross_entropy(self.model(x), y)
        return self.model(**batch).logits.float().square().mean()  # a Hugging Face dict batch, as keyword args

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


def vit_data(n: int = 8) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 4, (n,))), batch_size=4)


def first_step_activation_mib(tmp_path: Path, model: pl.LightningModule, data, callbacks: list) -> float:
    monitor = PeakMemoryMonitor(activation_every_n_steps=1)
    trainer(tmp_path, callbacks=[*callbacks, monitor], max_steps=1, max_epochs=1).fit(model, data)
    return monitor.history[0]["train"]["activation"]


def test_without_example_input_array_the_first_batch_converts_every_norm(tmp_path, caplog):
    """ViT-tiny, no example_input_array: all 24 block norms (and the final one, which the head reads through
    the class token) convert on the first training batch, and that very step (measured by PeakMemoryMonitor)
    already saves >= 30% fewer activation bytes than stock."""
    torch.manual_seed(0)
    stock, model = Backbone("vit"), Backbone("vit")
    model.load_state_dict(stock.state_dict())
    callback = LowMemBP()
    with caplog.at_level("INFO"):
        lowmem_mib = first_step_activation_mib(tmp_path, model, vit_data(), [callback])
    stock_mib = first_step_activation_mib(tmp_path, stock, vit_data(), [])
    report = callback.report
    norms = [e for e in report.converted if e.kind == "norm"]
    assert len(norms) == 25 and sum(isinstance(m, MemorySharingNorm) for m in model.modules()) == 25
    assert report.probe == "model(tensor[4, 3, 32, 32])" and not report.pending
    assert lowmem_mib <= 0.7 * stock_mib, (lowmem_mib, stock_mib)
    messages = [r.getMessage() for r in caplog.records if "LowMemBP" in r.getMessage()]
    assert "converted at the first training forward" in messages[0] and "probed on model(tensor[4" in messages[1]


def test_hugging_face_dict_batches_convert_through_keyword_arguments(tmp_path):
    model = Backbone("bert")
    data = DataLoader([{"input_ids": torch.randint(0, 128, (16,))} for _ in range(8)], batch_size=4)
    callback = LowMemBP()
    trainer(tmp_path, callbacks=[callback]).fit(model, data)
    assert callback.report.probe == "model(input_ids=tensor[4, 16])"
    assert sum(e.kind == "norm" for e in callback.report.converted) >= 4


def test_a_validation_run_first_leaves_the_model_stock_until_training(tmp_path, caplog):
    """Evaluation forwards (inference mode) save nothing and convert nothing; the first training one does."""
    model, callback = Module(late=True, example=False), LowMemBP()
    with caplog.at_level("INFO"):
        trainer(tmp_path, callbacks=[callback]).validate(model, loader())
    assert callback.report.pending and type(model.net[1]) is nn.Linear
    assert any("converted at the first training forward" in r.getMessage() for r in caplog.records)
    trainer(tmp_path, callbacks=[callback]).fit(model, loader())
    assert not callback.report.pending and isinstance(model.net[0], MemorySharingNorm)


def test_resume_without_example_converts_the_restored_model(tmp_path):
    model = Module(example=False)
    t = trainer(tmp_path, max_steps=2)
    t.fit(model, loader())
    ckpt = tmp_path / "step2.ckpt"
    t.save_checkpoint(ckpt)
    resumed = Module(example=False)
    t2 = trainer(tmp_path, max_steps=4)
    t2.fit(resumed, loader(), ckpt_path=ckpt)
    assert t2.global_step == 4 and isinstance(resumed.net[0], MemorySharingNorm)


def test_a_first_batch_the_model_cannot_run_changes_nothing(tmp_path):
    model, callback = Module(example=False), LowMemBP()
    bad = DataLoader(TensorDataset(torch.randn(8, 15), torch.randint(0, 4, (8,))), batch_size=4)
    with pytest.raises(RuntimeError, match=r"expected input with shape \[\*, 16\]"):  # the model's own error
        trainer(tmp_path, callbacks=[callback]).fit(model, bad)
    assert callback.report.pending and type(model.net[0]) is nn.LayerNorm and type(model.net[1]) is nn.Linear


def test_two_lowmem_callbacks_are_a_configuration_error(tmp_path):
    with pytest.raises(MisconfigurationException, match="more than one LowMemBP"):
        trainer(tmp_path, callbacks=[LowMemBP(), LowMemBP(bits=4)]).fit(Module(), loader())
