"""DeepSpeed ZeRO-2 and ZeRO-3 on this CPU (two ranks under torchrun, gloo, ``DS_ACCELERATOR=cpu``): a model converted
before ``deepspeed.initialize`` trains with stock's losses and gradients, the fused head kept (under ZeRO-3 it marks
its loss so that the head's partitioned weight is gathered for the backward); so does a model converted after the
engine was built (ZeRO-3 partitioned it: whole for the surgery's duration, its hooks registered anew) or after
``deepspeed.zero.Init`` partitioned it as it was built."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")


def two_ranks(script: str, out: Path) -> dict:
    """Rank 0's JSON of ``script`` run on two CPU ranks (torchrun, gloo, DeepSpeed's CPU accelerator)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
               str(Path(__file__).with_name(script)), str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return two_ranks("deepspeed_two_ranks.py", tmp_path_factory.mktemp("deepspeed") / "result.json")


@pytest.mark.parametrize("stage", [2, 3])
def test_converted_before_the_engine_trains_as_stock(result, stage):
    runs = result[f"zero{stage}"]
    assert {"gated MLP", "norm", "head", "attention"} <= set(result[f"converted-{stage}"])
    stock, lowmem = torch.tensor(runs["stock"]), torch.tensor(runs["lowmem"])
    assert stock.shape == lowmem.shape and stock.shape[1] > 10  # the loss, then every parameter's gradient
    torch.testing.assert_close(lowmem, stock, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", ["after-2", "after-3", "init-3"])
def test_converted_after_the_engine_or_zero_init_trains_as_stock(result, case):
    """``apply_lowmem`` on the engine's module (under ZeRO-3 partitioned) or on a model ``deepspeed.zero.Init``
    partitioned: everything converts, the head too, and the three steps' losses and gradients are stock's."""
    run = result[case]
    stock = run["stock"] if case == "init-3" else result[f"zero{case[-1]}"]["stock"]  # zero.Init draws its own
    assert {"gated MLP", "norm", "head", "attention"} <= set(run["converted"])
    torch.testing.assert_close(torch.tensor(run["steps"]), torch.tensor(stock), rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def lightning_result(tmp_path_factory):
    return two_ranks("lightning_deepspeed_two_ranks.py", tmp_path_factory.mktemp("lightning") / "result.json")


@pytest.mark.parametrize("case", ["zero2", "zero3", "zero3-first-batch"])
def test_lowmem_bp_under_lightnings_deepspeed_strategy(lightning_result, case):
    """``Trainer(strategy=DeepSpeedStrategy(stage=N), callbacks=[LowMemBP()])`` on ``example_input_array``: converted
    before the engine is built (under ZeRO-3 outside ``configure_model``'s ``zero.Init``); without one, under ZeRO-3,
    at the first batch inside the engine; the head kept, stock's losses."""
    run = lightning_result[case]
    assert {"gated MLP", "norm", "head"} <= set(run["converted"])
    torch.testing.assert_close(torch.tensor(run["lowmem"]), torch.tensor(run["stock"]), rtol=1e-5, atol=1e-6)
