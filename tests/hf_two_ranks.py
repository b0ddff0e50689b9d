"""One rank of ``test_hf_trainer.py``'s two-process runs (torchrun, gloo): ``hf_two_ranks.py TRAINER OUT`` trains
stock, then with ``LowMemCallback``; rank 0 writes both runs' per-step losses, the converted kinds and the report's
notes to OUT (JSON). TRAINER: ``Trainer``, ``SFTTrainer``, or ``Trainer-zero2`` / ``Trainer-zero3`` (the Trainer
under a DeepSpeed config, DeepSpeed's CPU accelerator)."""

import importlib
import json
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_trainer import LowMemCallback, sft_run, train


def main(trainer: str, out: str) -> None:
    callback = LowMemCallback()
    with tempfile.TemporaryDirectory() as scratch:
        if trainer.startswith("Trainer"):
            arguments = {"ddp_backend": "gloo"}
            if trainer != "Trainer":  # DeepSpeed; its shared-memory op takes minutes to build, gloo does the work
                importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
                zero = {"stage": int(trainer[-1])}
                arguments["deepspeed"] = {
                    "train_micro_batch_size_per_gpu": "auto",
                    "zero_optimization": zero,
                    "gradient_accumulation_steps": "auto",
                    "zero_allow_untested_optimizer": True,
                }
            stock, _ = train(Path(scratch), [], **arguments)
            lowmem, _ = train(Path(scratch), [callback], **arguments)
        else:
            stock, _, _ = sft_run(Path(scratch), [], bf16=False, ddp_backend="gloo")
            lowmem, _, _ = sft_run(Path(scratch), [callback], bf16=False, ddp_backend="gloo")
    if dist.get_rank() == 0:
        converted = sorted({entry.kind for entry in callback.report.converted})
        notes = callback.report.notes
        Path(out).write_text(json.dumps({"stock": stock, "lowmem": lowmem, "converted": converted, "notes": notes}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
