"""One rank of ``test_deepspeed.py``'s Lightning run (torchrun, gloo, DeepSpeed's CPU accelerator):
``lightning_deepspeed_two_ranks.py OUT`` fits a tiny LLaMA three steps under ``DeepSpeedStrategy`` stage 2 and 3,
stock and with ``LowMemBP`` (on ``example_input_array``, and under stage 3 on the first batch too); rank 0 writes the losses and the kinds converted to OUT
(JSON). Lightning's strategy refuses a CPU accelerator: a subclass here steps past that check alone."""

import importlib
import json
import sys
from pathlib import Path

import deepspeed
import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

sys.path.insert(0, str(Path(__file__).parents[1]))
from benchmarks import zoo
from lightning_lowmem import LowMemBP

STEPS = 3
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # as in deepspeed_two_ranks.py
_initialize = deepspeed.initialize


def _initialize_on_cpu(*args, **kwargs):
    """``deepspeed.initialize`` with the rank for device index: Lightning passes the root device's, None on a CPU."""
    if getattr(kwargs.get("args"), "device_rank", 0) is None:
        kwargs["args"].device_rank = torch.distributed.get_rank()
    return _initialize(*args, **kwargs)


deepspeed.initialize = _initialize_on_cpu


class CPUDeepSpeed(DeepSpeedStrategy):
    """Lightning's strategy past its CUDA-only checks (the accelerator's type, GPU indices per rank)."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        pl.seed_everything(0)
        self.set_world_ranks()
        self._init_deepspeed_distributed()


class TinyLlama(pl.LightningModule):
    def __init__(self, batch: dict[str, torch.Tensor], example: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model, self.batch, self.losses = zoo.llama(), batch, []
        self.example_input_array = {"batch": batch} if example else None

    def forward(self, batch: dict[str, torch.Tensor]):
        return self.model(**batch)

    def training_step(self, batch, index):
        loss = self(self.batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return [0] * STEPS


def fit(stage: int, lowmem: bool, example: bool = True) -> tuple[list[float], list[str]]:
    ids = torch.randint(3, zoo.VOCAB, (4, 64), generator=torch.Generator().manual_seed(1))
    module, callback = TinyLlama({"input_ids": ids, "labels": ids}, example), LowMemBP()
    strategy = CPUDeepSpeed(stage=stage, process_group_backend="gloo", config={
        "train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage}})  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, callbacks=[callback] if lowmem else [],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    return module.losses, sorted({e.kind for e in callback.report.converted}) if lowmem else []


def main(out: str) -> None:
    result = {}
    for stage in (2, 3):
        stock, _ = fit(stage, lowmem=False)
        lowmem, converted = fit(stage, lowmem=True)
        result[f"zero{stage}"] = {"stock": stock, "lowmem": lowmem, "converted": converted}
    lowmem, converted = fit(3, lowmem=True, example=False)  # converted at the first batch, inside the engine
    result["zero3-first-batch"] = {"stock": result["zero3"]["stock"], "lowmem": lowmem, "converted": converted}
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    # torn down before the interpreter exits: left to exit, a rank once aborted in teardown after its last fit
    # ("terminate called without an active exception", exit -6) under a loaded test run
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
