"""LowMemPrecision in real Trainer.fit runs on CPU, every precision mode.

The sharing is checked by storage pointer inside a Trainer training step: the storage an
MS norm saves must be the one the next linear saves, and a stock norm's consumers must all
save one tensor. The plugin's type is checked against Lightning's own plugin for each literal.
"""

from __future__ import annotations

import copy
import pickle
from collections import defaultdict
from typing import Self

import lightning.pytorch as pl
import lightning.pytorch.plugins.precision as lightning_precision
import pytest
import torch
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from lightning.pytorch.cli import _JSONARGPARSE_SIGNATURES_AVAILABLE as _JSONARGPARSE_AVAILABLE
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_lowmem import LowMemBP, LowMemPrecision
from lightning_lowmem.lightning.precision import LowMemHalfPrecision, LowMemMixedPrecision, is_norm
from lightning_lowmem.nn import MSLayerNorm, ReGELU2
from lightning_lowmem.surgery import apply_lowmem

D = 16
MODES = {  # literal: (compute dtype, autocast)
    "32-true": (torch.float32, False),
    "16-mixed": (torch.float16, True),
    "bf16-mixed": (torch.bfloat16, True),
    "16-true": (torch.float16, False),
    "bf16-true": (torch.bfloat16, False),
}


class TinyRMSNorm(nn.Module):
    """Written like HF's LlamaRMSNorm: fp32 statistics, ``weight * x.to(input dtype)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class SavedByModule:
    """Storage pointers autograd saves, by the innermost module running, and module outputs."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.saved: dict[str, set[int]] = defaultdict(set)
        self.outputs: dict[str, torch.Tensor] = {}
        self._stack: list[str] = []
        self._handles: list = []
        self._graph = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._stack:
            self.saved[self._stack[-1]].add(t.untyped_storage().data_ptr())
        return t

    def __enter__(self) -> Self:
        for name, module in self.model.named_children():
            self._handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self._stack.append(n)))
            self._handles.append(module.register_forward_hook(lambda m, a, out, n=name: self._leave(n, out)))
        self._graph.__enter__()
        return self

    def _leave(self, name: str, output: torch.Tensor) -> None:
        self._stack.pop()
        self.outputs[name] = output

    def __exit__(self, *exc) -> None:
        self._graph.__exit__(*exc)
        for handle in self._handles:
            handle.remove()

    def ptr(self, name: str) -> int:
        return self.outputs[name].untyped_storage().data_ptr()


class Block(pl.LightningModule):
    """MS norm -> MLP, stock LayerNorm -> q, k, v, HF-style RMSNorm -> head, on an fp32 residual."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.ms = MSLayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.act = ReGELU2()
        self.fc2 = nn.Linear(2 * D, D)
        self.ln = nn.LayerNorm(D)
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.rms = TinyRMSNorm(D)
        self.head = nn.Linear(D, 1)
        self.records: list[SavedByModule] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.inp(x)
        h = h + self.fc2(self.act(self.fc1(self.ms(h))))
        a = self.ln(h)
        h = h + self.q(a) * self.k(a) + self.v(a)
        return self.head(self.rms(h))

    def training_step(self, batch, batch_idx):
        with SavedByModule(self) as record:
            loss = self(batch).float().pow(2).mean()
        self.records.append(record)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 4, D), batch_size=4)


def fit(model: pl.LightningModule, plugin, ckpt_path=None, **kwargs) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, plugins=[plugin] if plugin else None, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("precision", list(MODES))
def test_fit_keeps_norms_fp32_and_shares_their_outputs(precision):
    compute_dtype, autocast = MODES[precision]
    model = Block()
    before = model.fc1.weight.detach().float().clone()
    trainer = fit(model, LowMemPrecision(precision))

    assert trainer.precision == precision
    assert not torch.equal(model.fc1.weight.detach().float(), before), "training did not update the weights"
    params = compute_dtype if not autocast else torch.float32
    assert model.fc1.weight.dtype == params
    assert model.ln.weight.dtype == model.rms.weight.dtype == torch.float32  # norms hold fp32 parameters

    record = model.records[-1]
    for norm in ("ms", "ln", "rms"):
        assert record.outputs[norm].dtype == compute_dtype, f"{norm} output in {record.outputs[norm].dtype}"
    # the MS norm saves its output, and it is the very storage fc1 saves
    assert record.ptr("ms") in record.saved["ms"]
    assert record.ptr("ms") in record.saved["fc1"]
    # one tensor for all three consumers of the stock LayerNorm
    for consumer in ("q", "k", "v"):
        assert record.ptr("ln") in record.saved[consumer], f"{consumer} saved its own copy of ln's output"


def test_stock_mixed_precision_makes_consumers_copy_the_norm_output():
    """The contrast: Lightning's own bf16-mixed lets q, k and v each save a bf16 copy."""
    model = Block()
    fit(model, None, precision="bf16-mixed")
    record = model.records[-1]
    assert record.outputs["ln"].dtype == torch.float32
    copies = [record.saved[name] - {record.ptr("ln")} for name in ("q", "k", "v")]
    assert all(copies) and not (copies[0] & copies[1]) and not (copies[1] & copies[2])


def test_fp16_grad_scaler_is_used():
    plugin = LowMemPrecision("16-mixed")
    trainer = fit(Block(), plugin)
    assert trainer.scaler is plugin.scaler is not None
    assert plugin.state_dict()["scale"] > 0  # the scaler ran: its state holds a scale
    assert LowMemPrecision("bf16-mixed").scaler is None


LIGHTNING_PLUGIN_TYPES = [
    c
    for c in vars(lightning_precision).values()
    if isinstance(c, type) and issubclass(c, lightning_precision.Precision)
]


@pytest.mark.filterwarnings("ignore:You passed `Trainer\\(accelerator='cpu', precision='16-mixed'\\)`")
@pytest.mark.parametrize("precision", list(MODES))
def test_plugin_is_of_lightnings_type_for_its_literal(precision):
    """Every isinstance check Lightning makes answers as for ``Trainer(precision=...)``'s own plugin,
    and ThroughputMonitor reads the compute dtype."""
    plugin = LowMemPrecision(precision)
    stock = pl.Trainer(accelerator="cpu", precision=precision, logger=False).precision_plugin
    assert {c.__name__ for c in LIGHTNING_PLUGIN_TYPES} >= {"Precision", "MixedPrecision", "HalfPrecision"}
    for plugin_type in LIGHTNING_PLUGIN_TYPES:
        assert isinstance(plugin, plugin_type) == isinstance(stock, plugin_type), plugin_type
    assert isinstance(plugin, LowMemPrecision)
    assert _plugin_to_compute_dtype(plugin) == MODES[precision][0]


def test_checkpoint_restores_the_grad_scaler(tmp_path):
    """Lightning saves and restores the fp16 grad scaler's state, as for its own MixedPrecision."""
    trained = LowMemPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    trainer = fit(Block(), trained)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    resumed = LowMemPrecision("16-mixed")
    assert resumed.scaler.get_scale() != trained.scaler.get_scale()
    fit(Block(), resumed, ckpt_path=tmp_path / "last.ckpt")
    assert resumed.scaler.get_scale() == trained.scaler.get_scale()


@pytest.mark.parametrize("precision", list(MODES))
def test_pickle_and_deepcopy_keep_type_and_state(precision):
    plugin = LowMemPrecision(precision)
    for clone in (copy.deepcopy(plugin), pickle.loads(pickle.dumps(plugin))):
        assert type(clone) is type(plugin)
        assert repr(clone) == repr(plugin) == f"LowMemPrecision({precision!r})"
        assert _plugin_to_compute_dtype(clone) == MODES[precision][0]
        if precision == "16-mixed":
            assert clone.scaler is not plugin.scaler and clone.scaler.state_dict() == plugin.scaler.state_dict()


def test_converted_model_pickles_with_its_norm_hooks():
    model = nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D))
    LowMemPrecision("bf16-true").convert_module(model)
    clone = pickle.loads(pickle.dumps(model))
    assert clone[1].weight.dtype == torch.float32
    assert clone(torch.randn(2, D, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_subclasses_refuse_other_modes_literals():
    with pytest.raises(ValueError, match="LowMemHalfPrecision.*precision must be one of 16-true, bf16-true"):
        LowMemHalfPrecision("bf16-mixed")
    with pytest.raises(ValueError, match="Precision must be '16-mixed' or 'bf16-mixed'"):
        LowMemMixedPrecision("bf16-true")
    assert LowMemHalfPrecision("16-true")._desired_input_dtype == torch.float16


def test_precision_flag_and_plugin_together_is_lightnings_error():
    with pytest.raises(
        ValueError, match=r"Received both `precision=bf16-mixed` and `plugins=LowMemPrecision\('16-true'\)`"
    ):
        pl.Trainer(accelerator="cpu", precision="bf16-mixed", plugins=[LowMemPrecision("16-true")])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="precision must be one of"):
        LowMemPrecision("64-true")
    with pytest.raises(MisconfigurationException, match="does not use a grad scaler"):
        LowMemPrecision("bf16-mixed", scaler=torch.amp.GradScaler(device="cpu"))


def test_autocast_device_must_match_the_model():
    with pytest.raises(MisconfigurationException, match="device='cpu'"):
        fit(Block(), LowMemPrecision("bf16-mixed", device="cuda"))


class Unrecorded(Block):
    """No recording hooks in the training step (the surgery at the first batch leaves hooked modules alone)."""

    def training_step(self, batch, batch_idx):
        return self(batch).float().pow(2).mean()


@pytest.mark.parametrize("precision", list(MODES))
def test_hooked_norms_convert_at_the_first_batch(precision):
    """Without example_input_array LowMemBP converts after the plugin hooked the stock norms' outputs: the
    hook goes with the replaced norm (a memory-sharing norm returns the compute dtype itself), and it leaves
    the float64 check of a norm's function alone."""
    model = Unrecorded()
    callback = LowMemBP()
    fit(model, LowMemPrecision(precision), callbacks=[callback])
    assert isinstance(model.ln, MSLayerNorm) and ("ln", "converted") in [
        (e.name, e.status) for e in callback.report.entries
    ]


def test_fsdp_is_refused_by_name():
    """FSDPStrategy requires an FSDPPrecision (LowMemFSDPPrecision, tests/test_fsdp.py); the Trainer assigns the
    plugin to the strategy, which refuses this one."""
    with pytest.raises(TypeError, match=r"FSDPPrecision.*LowMemPrecision\('bf16-mixed'\)"):
        FSDPStrategy().precision_plugin = LowMemPrecision("bf16-mixed")


@pytest.mark.skipif(not _JSONARGPARSE_AVAILABLE, reason="LightningCLI needs jsonargparse[signatures] (test extra)")
@pytest.mark.parametrize("precision", list(MODES))
def test_lightning_cli_yaml_class_path(tmp_path, precision):
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  logger: false\n  plugins:\n"
        f"    - class_path: lightning_lowmem.LowMemPrecision\n      init_args:\n        precision: {precision}\n"
    )
    cli = LightningCLI(Block, run=False, args=["--config", str(config)], save_config_kwargs={"overwrite": True})
    assert type(cli.trainer.precision_plugin) is type(LowMemPrecision(precision))
    assert cli.trainer.precision == precision


def test_norm_detection():
    assert all(is_norm(m) for m in (nn.LayerNorm(4), nn.BatchNorm2d(4), nn.RMSNorm(4), MSLayerNorm(4), TinyRMSNorm(4)))
    assert not any(is_norm(m) for m in (nn.Linear(4, 4), nn.GELU(), nn.Dropout()))


def test_setting_up_twice_installs_one_hook():
    model = Block()
    plugin = LowMemPrecision("bf16-true")
    plugin.convert_module(model)
    plugin.convert_module(model)
    assert len(model.ln._forward_hooks) == 1


class PreNorm(pl.LightningModule):
    """Stock pre-norm block for model surgery: LayerNorm -> fc1 -> GELU -> fc2 on a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * D, D)
        self.records: list[SavedByModule] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.inp(x)
        return h + self.fc2(self.act(self.fc1(self.norm(h))))

    training_step, configure_optimizers, train_dataloader = (
        Block.training_step,
        Block.configure_optimizers,
        Block.train_dataloader,
    )


@pytest.mark.parametrize("precision", list(MODES))
def test_surgery_norm_shares_with_its_consumer_in_a_trainer_step(precision):
    """After apply_lowmem the norm's affine lives in fp32 and the normalized tensor it saves is what fc1 saves
    (not its output, which nothing keeps)."""
    compute_dtype, _ = MODES[precision]
    model = PreNorm()
    apply_lowmem(model, example_input=torch.randn(4, 4, D))
    fit(model, LowMemPrecision(precision))
    assert model.norm.weight.dtype == model.norm.bias.dtype == torch.float32
    record = model.records[-1]
    assert record.outputs["norm"].dtype == compute_dtype
    assert record.saved["norm"] & record.saved["fc1"]
    assert record.ptr("norm") not in record.saved["norm"] | record.saved["fc1"]
