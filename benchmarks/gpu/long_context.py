"""Stage ``long_context``: the longest sequence one real-dims model trains in a memory budget, predicted by
:func:`lightning_lowmem.max_sequence_length` on the device and then found by search.

Llama-3.2-1B at its full depth (16 layers, hidden 2,048, vocabulary 128,256, tied), bf16 weights, peft LoRA r=16 on
every linear (dropout 0.05), bf16 autocast, AdamW, batch 1, converted and with every step of the ladder (every MLP
tiled, every block checkpointed, its input offloaded to pinned host memory). The process is held to the budget
(``torch.cuda.set_per_process_memory_fraction``): a step that does not fit fails with the allocator's
out-of-memory error. The search halves the interval between a length that trains and one that does not.
"""

from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import markdown_table
from benchmarks.gpu.models import GIB, Setting, batch_for, training_step
from benchmarks.real_scale import CONFIGS, SMOKE, build
from lightning_lowmem import apply_lowmem, max_sequence_length
from lightning_lowmem.surgery.budget import RUNGS, take_every_step
from lightning_lowmem.surgery.convert import Surgery
from lightning_lowmem.surgery.training_memory import with_length

MODEL = "Llama-3.2-1B"


class StopSearch(Exception):
    """The smoke run's trials are done."""


def trains(step: Callable[[], object], device: torch.device) -> tuple[bool, float, float]:
    """Whether ``step`` runs within the budget; its seconds and peak GiB."""
    started = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except torch.OutOfMemoryError:
        return False, time.perf_counter() - started, 0.0
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
    return True, time.perf_counter() - started, peak


def search(
    device: torch.device, budget_gib: float, smoke: bool, emit: Callable[[str], None], seconds: float = float("inf")
) -> str:
    """Predict, then search (markdown; ``emit`` gets the text so far after each trial) for at most ``seconds`` (the
    interval found by then is the answer). On the CPU nothing holds the process to the budget: the smoke run stops
    after three trials."""
    deadline = time.perf_counter() + seconds
    config = SMOKE["tiny LLaMA"] if smoke else CONFIGS[MODEL]
    if device.type == "cuda" and device.index is None:  # the memory fraction is set for one device, by index
        device = torch.device("cuda", torch.cuda.current_device())
    x: Any = batch_for(config, Setting(config.name, None, 256 if smoke else 1024), device)
    with tempfile.TemporaryDirectory() as directory, device:
        model = build(config, config.layers, "lora", directory)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        started = time.perf_counter()
        predicted = max_sequence_length(model, x, budget_gib, "adamw", ladder=RUNGS)
        predict_seconds = time.perf_counter() - started
        apply_lowmem(model, example_input=x, verify=False, measure=False)
        plan = take_every_step(model, x, Surgery(model), RUNGS)
    if device.type == "cuda":
        gc.collect()  # what the prediction measured: not held in the allocator's cache against the budget
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_gib * GIB / total), device)
    intro = (
        f"{config.name} at full depth ({config.layers} layers), LoRA r=16, bf16 autocast, AdamW, batch 1, budget "
        f"{budget_gib:g} GiB. Ladder: {plan.summary()}. `max_sequence_length(..., ladder=RUNGS)` predicted "
        f"**{predicted:,} tokens** ({predict_seconds:.0f} s).\n\n"
    )
    rows: list[list[str]] = []

    def trial(length: int) -> bool:
        if (smoke and len(rows) == 3) or time.perf_counter() > deadline:
            raise StopSearch
        step = training_step(model, with_length(x, length))
        ok, seconds, peak = trains(step, device)
        if ok:  # the optimizer's state exists from the first step on: time the second
            ok, seconds, peak = trains(step, device)
        model.zero_grad(set_to_none=True)
        gc.collect()  # a failed step's graph
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append([f"{length:,}", "trains" if ok else "out of memory", f"{seconds:.1f} s", f"{peak:.2f}"])
        print(" | ".join(rows[-1]), flush=True)
        emit(intro + markdown_table(["tokens", "step", "time", "peak GiB"], rows))
        return ok

    low, high = max(1, predicted // 2), predicted
    try:
        while trial(high):  # grow until a length does not train
            low, high = high, round(1.25 * high)
            if high > 4 * predicted:
                break
        if not trial(low):  # the prediction overshot by more than half: look lower
            high, low = low, 1
        while high - low > max(1, low // 50):  # to 2%
            middle = (low + high) // 2
            low, high = (middle, high) if trial(middle) else (low, middle)
    except StopSearch:
        pass
    finally:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    stopped = f" (the search stopped at its {seconds:.0f} s)" if time.perf_counter() > deadline else ""
    found = (
        "The smoke run: three trials, nothing found."
        if smoke
        else f"Found by search{stopped}: **{low:,} tokens** train, {high:,} do not (predicted / found: "
        f"{predicted / low:.3f})."
    )
    return intro + found + "\n\n" + markdown_table(["tokens", "step", "time", "peak GiB"], rows)
