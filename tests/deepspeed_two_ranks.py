"""One rank of ``test_deepspeed.py``'s two-process run (torchrun, gloo, DeepSpeed's CPU accelerator):
``deepspeed_two_ranks.py OUT`` trains a tiny LLaMA three steps under ZeRO-2 and ZeRO-3, stock and converted by
``apply_lowmem`` before ``deepspeed.initialize`` (the fused head kept: 4 x 64 tokens), converted after it (the
engine's module, partitioned under ZeRO-3) and, under ZeRO-3, converted after ``deepspeed.zero.Init`` partitioned it
(as ``from_pretrained`` does under a zero3 config); rank 0 writes every step's loss and full gradients' norms and the
kinds converted to OUT (JSON)."""

import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import deepspeed

from benchmarks import zoo
from lightning_lowmem import apply_lowmem

STEPS = 3
# its shared-memory op takes minutes to build; gloo does the work (deepspeed.comm.torch is torch as an attribute)
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def config_of(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True}  # fmt: skip


def engine_of(model: torch.nn.Module, stage: int):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config_of(stage))[0]


def train(engine, batch) -> list[list[float]]:
    """Per step: the loss, then each trainable parameter's full gradient's norm (gathered across the ranks)."""
    steps = []
    for _ in range(STEPS):
        loss = engine(**batch).loss
        engine.backward(loss)
        grads = [deepspeed.utils.safe_get_full_grad(p) for p in engine.module.parameters() if p.requires_grad]
        steps.append([loss.item(), *(float(g.float().norm()) for g in grads)])
        engine.step()
    return steps


def main(out: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    ids = torch.randint(3, zoo.VOCAB, (4, 64), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    result = {}
    for stage in (2, 3):
        runs = {}
        for lowmem in (False, True):
            torch.manual_seed(0)
            model = zoo.llama()
            if lowmem:
                report = apply_lowmem(model, example_input=batch)
                result[f"converted-{stage}"] = sorted({e.kind for e in report.converted})
            runs["lowmem" if lowmem else "stock"] = train(engine_of(model, stage), batch)
        result[f"zero{stage}"] = runs
        torch.manual_seed(0)
        engine = engine_of(zoo.llama(), stage)  # converted after the engine partitioned it (ZeRO-3) or not
        report = apply_lowmem(engine.module, example_input=batch)
        result[f"after-{stage}"] = {
            "converted": sorted({e.kind for e in report.converted}),
            "steps": train(engine, batch),
        }
    runs = {}
    for lowmem in (False, True):
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=config_of(3)):  # partitioned as it is built, no engine yet
            model = zoo.llama()
        if lowmem:
            runs["converted"] = sorted({e.kind for e in apply_lowmem(model, example_input=batch).converted})
        runs["steps" if lowmem else "stock"] = train(engine_of(model, 3), batch)
    result["init-3"] = runs
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # torn down before the interpreter exits (as lightning_deepspeed_two_ranks)


if __name__ == "__main__":
    main(*sys.argv[1:])
