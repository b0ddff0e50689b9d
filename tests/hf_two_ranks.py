"""One rank of ``test_hf_trainer.py``'s two-process runs (torchrun, gloo): ``hf_two_ranks.py Trainer|SFTTrainer OUT``
trains stock, then with ``LowMemCallback``; rank 0 writes both runs' per-step losses and the converted kinds to
OUT (JSON)."""

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
        if trainer == "Trainer":
            stock, _ = train(Path(scratch), [], ddp_backend="gloo")
            lowmem, _ = train(Path(scratch), [callback], ddp_backend="gloo")
        else:
            stock, _, _ = sft_run(Path(scratch), [], bf16=False, ddp_backend="gloo")
            lowmem, _, _ = sft_run(Path(scratch), [callback], bf16=False, ddp_backend="gloo")
    if dist.get_rank() == 0:
        converted = sorted({entry.kind for entry in callback.report.converted})
        Path(out).write_text(json.dumps({"stock": stock, "lowmem": lowmem, "converted": converted}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
