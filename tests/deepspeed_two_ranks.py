"""One rank of ``test_deepspeed.py``'s two-process run (torchrun, gloo, DeepSpeed's CPU accelerator):
``deepspeed_two_ranks.py OUT`` trains a tiny LLaMA three steps under ZeRO-2 and ZeRO-3, stock and converted by
``apply_lowmem`` before ``deepspeed.initialize`` (the fused head kept: 4 x 64 tokens), and converts an engine's
partitioned module after it; rank 0 writes every step's loss and full gradients' norms, the kinds converted and what
the conversion after the engine did to OUT (JSON)."""

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


def engine_of(model: torch.nn.Module, stage: int):
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True}  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


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
        kinds = [type(m).__name__ for m in engine.module.modules()]
        try:
            report = apply_lowmem(engine.module, example_input=batch)
            result[f"after-{stage}"] = {"converted": sorted({e.kind for e in report.converted}),
                                        "losses": [step[0] for step in train(engine, batch)]}  # fmt: skip
        except ValueError as err:
            unchanged = kinds == [type(m).__name__ for m in engine.module.modules()]
            result[f"after-{stage}"] = {"error": str(err), "unchanged": unchanged}
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
