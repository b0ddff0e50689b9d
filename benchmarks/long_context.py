"""The longest context one GPU trains, predicted: batch 1, at 24 and 80 GiB, stock, stock with every layer
checkpointed, lightning-lowmem by default and with the budget's whole ladder (every MLP tiled, every block
checkpointed, its input offloaded to host memory), for Llama-3.1-8B QLoRA nf4 r=32 (Unsloth's row: 78,475 tokens on
24 GB), LLaMA-2-7B QLoRA r=64 (the paper's) and Qwen2.5-7B LoRA r=16.

How: :func:`lightning_lowmem.training_memory` (weights with their 4-bit state, gradients, AdamW state, the
activations one forward saves and the step's measured peak beyond them: the backward's gradients, recomputed
blocks and tiles) of 1- and 2-layer models at each model's real dims, at two lengths, extrapolated to full depth
(every term is linear in the depth), then ``max_length`` of the budget. With offloading the blocks' inputs live in
host memory (``layers x hidden x 2 B`` per token, reported): the device's activations are the 1-layer model's
(the block being recomputed, its input brought back) and do not grow with the depth. Memory is measured on this
CPU (the step's allocation peak from the profiler's events): a GPU's context, kernels' workspace and the
allocator's fragmentation are not counted; leave room for them. Predicted overhead: the FLOPs recomputed per
forward FLOP (measured at the measurement's length; attention's share grows with the length).

    python benchmarks/long_context.py            # writes RESULTS.md "long context" and the README table
    python benchmarks/long_context.py --timing   # each rung's step time on this CPU (a quiet machine): "ladder timing"
    python benchmarks/long_context.py --smoke    # tiny shapes, nothing written
"""

from __future__ import annotations

import argparse
import copy
import gc
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import interleaved_times, markdown_table, paired_ratio, write_section
from benchmarks.real_scale import (
    CONFIGS,
    DECODER_BLOCKS,
    README,
    RECIPES,
    SMOKE,
    Config,
    bf16,
    build,
    example,
    extrapolate,
    quiet,
)
from lightning_lowmem import training_memory
from lightning_lowmem.surgery.apply import run
from lightning_lowmem.surgery.budget import take_every_step
from lightning_lowmem.surgery.convert import Surgery
from lightning_lowmem.surgery.options import Options
from lightning_lowmem.surgery.report import LowMemReport
from lightning_lowmem.surgery.training_memory import GIB, TrainingMemory

BLOCKS = {"checkpoint": DECODER_BLOCKS}  # a 1-layer model's one block, named (nothing repeats)
MEASURED_TILE = 32
"""Positions per MLP tile while measuring: several tiles at the measured lengths, so that the fit's per-token terms
hold no MLP intermediates; the plan's own tiles (the default, the hidden size) hold that many positions' worth,
added as a constant: (per-token peak untiled - tiled) x tile."""
LADDER = "lightning-lowmem + ladder (tile, checkpoint, offload)"
PLANS = {  # name -> (training_memory keywords, offloaded); offload measured on the host: see the module docstring
    "stock": ({"lowmem": False}, False),
    "stock, every layer checkpointed": ({"lowmem": False, "ladder": ["checkpoint"], **BLOCKS}, False),
    "lightning-lowmem (defaults)": ({}, False),
    "lightning-lowmem, every layer checkpointed": ({"ladder": ["checkpoint"], **BLOCKS}, False),
    LADDER: ({"ladder": ["tile", "checkpoint"], "tile_tokens": MEASURED_TILE, **BLOCKS}, True),
}
BUDGETS_GIB = (24, 80)


@dataclass(frozen=True)
class Row:
    model: str
    recipe: str
    quantized: bool


ROWS = [
    Row("Llama-3-8B", "QLoRA nf4 r=32", True),  # Llama-3.1-8B's dims are Llama-3-8B's
    Row("LLaMA-2-7B", "QLoRA nf4 r=64", True),
    Row("Qwen2.5-7B", "LoRA r=16", False),
]
LORA = {"QLoRA nf4 r=32": 32, "QLoRA nf4 r=64": 64, "LoRA r=16": 16}


def memories(config: Config, row: Row, tokens: int) -> dict[str, tuple[TrainingMemory, float]]:
    """Each plan's full-depth :class:`TrainingMemory` and the FLOPs it recomputes per forward FLOP (at full depth,
    from the 2-layer model's per-block FLOPs)."""
    recipe = "qlora" if row.quantized else "lora"
    RECIPES[recipe][1].update(r=LORA[row.recipe], lora_alpha=2 * LORA[row.recipe], lora_dropout=0.0)
    depth: dict[str, list[TrainingMemory]] = {name: [] for name in PLANS}
    overhead: dict[str, float] = {}
    for layers in (1, 2):
        with tempfile.TemporaryDirectory() as directory:
            model = build(config, layers, recipe, directory)
        x, _ = example(config, tokens)
        for name, (keywords, _) in PLANS.items():
            started = time.perf_counter()
            with bf16():
                depth[name].append(training_memory(model, x, "adamw", **keywords))
                if layers == 2 and keywords.get("ladder"):
                    overhead[name] = recompute_fraction(model, x, keywords, config.layers)
            print(f"  {config.name}, {layers} layer(s), {name}: {depth[name][-1].summary()} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
        del model
        gc.collect()
    out = {}
    for name, (_, offloaded) in PLANS.items():
        one, two = depth[name]
        memory = extrapolate(one, two, config.layers)
        if offloaded:  # the activations of the block being recomputed only: the 1-layer model's
            fields = ("constant", "linear", "quadratic", "transient", "transient_linear", "transient_quadratic")
            memory = replace(memory, **{f: getattr(one, f) for f in fields})
        if name == LADDER:  # the plan's own tiles: the hidden size's positions of the MLP's recompute at once
            untiled = depth["lightning-lowmem, every layer checkpointed"][0]
            held = max(untiled.per_token - one.per_token, 0.0) * config.hidden
            memory = replace(memory, transient=memory.transient + held)
        out[name] = (memory, overhead.get(name, 0.0))
    return out


def recompute_fraction(model: torch.nn.Module, x: object, keywords: dict, layers: int) -> float:
    """FLOPs the plan recomputes per forward FLOP at ``layers`` blocks, from the 2-layer ``model`` (converted, then put
    back): the blocks' (and their tiles') FLOPs scale with the depth, the embedding's and the head's do not."""
    options = Options(verify=False, measure=False)
    surgery = run(LowMemReport(), model, options, x) if keywords.get("lowmem", True) else Surgery(model)
    try:
        plan = take_every_step(model, x, surgery, keywords["ladder"], keywords["checkpoint"])
    finally:
        surgery.rollback()
    blocks = sum(b.flops for b in plan.blocks)
    scale = layers / len(plan.blocks)
    return plan.recomputed_flops * scale / (plan.forward_flops - blocks + blocks * scale)


def recomputed(fraction: float, quantized: bool) -> str:
    """The FLOPs-recomputed cell: torch's FLOP counter does not see bitsandbytes' 4-bit matmuls, so a QLoRA model's
    fraction would count its adapters and attention only."""
    if not fraction:
        return "-"
    return "(4-bit matmuls not counted)" if quantized else f"{100 * fraction:.0f}%"


def table(tokens: int, smoke: bool) -> str:
    rows = []
    context = multiprocessing.get_context("spawn")
    for row in ROWS[:1] if smoke else ROWS:
        config = SMOKE["tiny LLaMA"] if smoke else CONFIGS[row.model]
        if smoke:
            measured = memories(config, row, tokens)
        else:  # each model in a process of its own: glibc keeps the freed heap of the last 8B model
            with ProcessPoolExecutor(1, mp_context=context, initializer=quiet) as pool:
                measured = pool.submit(memories, config, row, tokens).result()
        for name, (memory, fraction) in measured.items():
            lengths = [memory.max_length(budget * GIB) for budget in BUDGETS_GIB]
            host = 2 * config.hidden * config.layers if PLANS[name][1] else 0
            rows.append([
                "Llama-3.1-8B" if row.model == "Llama-3-8B" else row.model, row.recipe, name,
                *(f"{length:,}" for length in lengths), f"{memory.static_bytes / GIB:.2f} GiB",
                f"{memory.per_token / 1024:.1f} KiB", recomputed(fraction, row.quantized),
                f"{host / 1024:.0f} KiB ({host * lengths[0] / GIB:.0f} GiB at {lengths[0]:,})" if host else "-",
            ])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    header = [
        "model (batch 1)", "recipe", "plan", f"max tokens, {BUDGETS_GIB[0]} GiB", f"max tokens, {BUDGETS_GIB[1]} GiB",
        "fixed (weights, state, constant activations)", "per token (device)", "FLOPs recomputed per forward FLOP",
        "host memory per token (at 24 GiB's length)",
    ]  # fmt: skip
    return markdown_table(header, rows)


TIMED = {  # name -> rungs, every step taken (offload copies to host memory: here, from the CPU to the CPU)
    "lightning-lowmem (defaults)": (),
    "+ tile every MLP": ("tile",),
    "+ checkpoint every block": ("checkpoint",),
    "+ tile + checkpoint": ("tile", "checkpoint"),
    "+ tile + checkpoint + offload": ("tile", "checkpoint", "offload"),
}


def timing(smoke: bool) -> str:
    """Step time (forward and backward) of a LLaMA-architecture LoRA model per plan, interleaved, ratio to the
    converted model without the ladder: what each rung costs on this CPU. Offload is taken by telling the budget
    that the host is elsewhere (it copies each block's input to host memory and back, as on a device)."""
    from lightning_lowmem import apply_lowmem
    from lightning_lowmem.surgery import budget

    hidden, layers, tokens = (64, 2, 256) if smoke else (512, 4, 2048)
    config = Config(
        "LLaMA (timing)", "Llama", hidden, round(hidden * 11008 / 4096), hidden // 64, hidden // 64, layers, 32000
    )
    RECIPES["lora"][1].update(r=16, lora_alpha=32, lora_dropout=0.05)
    base = build(config, layers, "lora", "", attention="sdpa").float()
    x, _ = example(config, tokens)
    steps = {}
    host, budget.HOST = budget.HOST, torch.device("meta")  # the model counts as on a device: offload is taken
    try:
        for name, rungs in TIMED.items():
            model = copy.deepcopy(base)
            apply_lowmem(model, example_input=x, verify=False, measure=False)
            if rungs:
                take_every_step(model, x, Surgery(model), rungs, DECODER_BLOCKS, tile_tokens=hidden)

            def step(model: torch.nn.Module = model) -> None:
                model.zero_grad(set_to_none=True)
                model(**x).loss.backward()

            steps[name] = step
    finally:
        budget.HOST = host
    times = interleaved_times(steps, repeats=3 if smoke else 15, warmup=1)
    reference = times["lightning-lowmem (defaults)"]
    rows = []
    for name, samples in times.items():
        ratio, low, high = paired_ratio(samples, reference)
        rows.append(
            [name, f"{1e3 * sorted(samples)[len(samples) // 2]:.0f} ms", f"{ratio:.2f}x ({low:.2f}-{high:.2f})"]
        )
    header = [
        "plan (every step of its rungs)",
        f"step, {tokens} tokens (median)",
        "vs the converted model (95% interval)",
    ]
    return (
        f"LLaMA-2 proportions at hidden {hidden}, {layers} layers, vocabulary 32,000, LoRA r=16 on every linear, "
        f"`lora_dropout` 0.05, fp32, batch 1 x {tokens} tokens, tiles of {hidden} positions; forward and backward, "
        "median of interleaved rounds, each round's ratio to the converted model without the ladder.\n\n"
        + markdown_table(header, rows)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny LLaMA, nothing written")
    parser.add_argument("--tokens", type=int, default=128, help="the first measurement length (and 2 x it + 1)")
    parser.add_argument("--timing", action="store_true", help="each rung's step time on this CPU, then exit")
    args = parser.parse_args()
    quiet()
    if args.timing:
        body = timing(args.smoke)
        print(body)
        if not args.smoke:
            section = "## Long context: what each rung of the ladder costs (CPU)\n\n" + body
            write_section("ladder_timing", section, "python benchmarks/long_context.py --timing")
        return
    body = table(16 if args.smoke else args.tokens, args.smoke)
    print(body)
    if args.smoke:
        return
    write_sections(body)


EXPLANATION = (
    "Batch 1, AdamW, LoRA adapters without dropout. `lightning_lowmem.training_memory` of 1- and 2-layer models at "
    "each model's real dims (random init; QLoRA as peft's `prepare_model_for_kbit_training` leaves it: embedding and "
    "head in fp32) at 128 and 257 tokens: weights with their 4-bit state, gradients, AdamW state, the activations one "
    "forward saves and the step's measured peak beyond them (the backward's gradients, recomputed blocks and tiles); "
    "every term extrapolated to full depth, then the longest length that fits. The ladder: every MLP tiled (tiles of "
    "the hidden size), every block checkpointed, its input in host memory (pinned; its size per token is the last "
    "column): the device's activations are then one block's recompute and do not grow with the depth. Measured on "
    "this CPU (the profiler's allocation events): a GPU's context, kernels' workspace and fragmentation are not "
    "counted; leave room for them. Memory only: LLaMA-2's RoPE was trained to 4,096 positions. Unsloth's README, for "
    "comparison: Llama-3.1-8B QLoRA r=32 on 24 GB, 78,475 tokens (Hugging Face + FlashAttention-2: 5,789); 342,733 "
    "on 80 GB."
)


def write_sections(body: str) -> None:
    """RESULTS.md's "long context" section and the README's."""
    section = "## Long context: the longest sequence one GPU trains, predicted\n\n" + EXPLANATION + "\n\n" + body
    command = "python benchmarks/long_context.py"
    write_section("long_context", section, command)
    write_section("long_context", section.replace("## Long context", "### Long context"), command, README)


if __name__ == "__main__":
    main()
