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
allocator's fragmentation are not counted; leave room for them. Predicted step time: each plan's training step's
FLOPs (counted at 128, 256 and 512 tokens, recomputes included, as a GPU runs them: ``constant + linear T +
quadratic T^2``, the quadratic part attention's) at the 24 GiB length, over its model's without recompute, at 400 TFLOP/s, plus the
checkpoints' trip to the host and back at 25 GB/s, not overlapped.

    python benchmarks/long_context.py            # writes RESULTS.md "long context" and the docs' table
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
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import interleaved_times, markdown_table, paired_ratio, warn_if_busy, write_section
from benchmarks.real_scale import (
    CONFIGS,
    DECODER_BLOCKS,
    DOCS,
    RECIPES,
    SMOKE,
    Config,
    bf16,
    build,
    example,
    extrapolate,
    full_depth,
    quiet,
)
from lightning_lowmem.surgery.apply import while_converted
from lightning_lowmem.surgery.budget import DEVICE_FLOPS, HOST_LINK, take_every_step
from lightning_lowmem.surgery.convert import Surgery
from lightning_lowmem.surgery.example import isolated
from lightning_lowmem.surgery.flops import flop_counter
from lightning_lowmem.surgery.training_memory import GIB, TrainingMemory, fit_lengths, polynomial, with_length

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


def memories(config: Config, row: Row, tokens: int) -> dict[str, tuple[TrainingMemory, Flops]]:
    """Each plan's full-depth :class:`TrainingMemory` and training step's FLOPs."""
    recipe = "qlora" if row.quantized else "lora"
    RECIPES[recipe][1].update(r=LORA[row.recipe], lora_alpha=2 * LORA[row.recipe], lora_dropout=0.0)
    lengths = (tokens, 2 * tokens + 1)
    counted = (tokens, 2 * tokens, 4 * tokens)  # multiples of the measured tile
    depth: dict[str, list[tuple[TrainingMemory, Flops]]] = {name: [] for name in PLANS}
    for layers in (1, 2):
        with tempfile.TemporaryDirectory() as directory:
            model = build(config, layers, recipe, directory)
        x, _ = example(config, tokens)
        for name, (keywords, _) in PLANS.items():
            started = time.perf_counter()
            options = dict(keywords)
            lowmem, ladder = options.pop("lowmem", True), options.pop("ladder", ())
            with bf16(), while_converted(model, x, options, "long_context", lowmem, ladder):
                memory = fit_lengths(model, x, lengths, "adamw")
                flops = Flops.fit(counted, [step_flops(model, with_length(x, n)) for n in counted])
            depth[name].append((memory, flops))
            print(f"  {config.name}, {layers} layer(s), {name}: {memory.summary()}; {flops} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
        del model
        gc.collect()
    out = {}
    for name, (_, offloaded) in PLANS.items():
        (one, one_flops), (two, two_flops) = depth[name]
        memory = extrapolate(one, two, config.layers)
        if offloaded:  # the activations of the block being recomputed only: the 1-layer model's
            terms = ("constant", "linear", "quadratic", "transient", "transient_linear", "transient_quadratic")
            memory = replace(memory, **{t: getattr(one, t) for t in terms})
        if name == LADDER:  # the plan's own tiles: the hidden size's positions of the MLP's recompute at once
            untiled = depth["lightning-lowmem, every layer checkpointed"][0][0]
            held = max(untiled.per_token - one.per_token, 0.0) * config.hidden
            memory = replace(memory, transient=memory.transient + held)
        out[name] = (memory, one_flops.at_depth(two_flops, config.layers))
    return out


@dataclass(frozen=True)
class Flops:
    """A training step's FLOPs (forward, backward and the recomputes in it): ``constant + linear T + quadratic T^2``
    (the quadratic term attention's; the constant the one tile a tiled recompute skips: its last, still held)."""

    constant: float
    linear: float
    quadratic: float

    @classmethod
    def fit(cls, lengths: tuple[int, ...], counted: list[int]) -> Flops:
        return cls(*polynomial(lengths, counted))

    def at(self, tokens: int) -> float:
        return self.constant + self.linear * tokens + self.quadratic * tokens**2

    def at_depth(self, two: Flops, layers: int) -> Flops:
        """From this 1-layer fit and the 2-layer one, at ``layers`` blocks (each term linear in the depth)."""
        return Flops(*(full_depth(getattr(self, f.name), getattr(two, f.name), layers) for f in fields(self)))

    def __str__(self) -> str:
        return f"step {self.linear / 1e9:.2f} GFLOP per token + {self.quadratic / 1e6:.2f} MFLOP per token pair"


def step_flops(model: torch.nn.Module, x: dict) -> int:
    """FLOPs of one training step on ``x`` (recomputes included), as a GPU would run it (:func:`flop_counter`)."""
    with isolated(model, train=True), flop_counter() as counter:
        model(**x).loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def overhead(plan: str, flops: dict[str, Flops], tokens: int, moved_bytes: float) -> str:
    """The plan's predicted step time over its model's without recompute (stock's, or the converted model's) at
    ``tokens``: FLOPs at :data:`DEVICE_FLOPS`, the checkpoints' trip to the host and back at :data:`HOST_LINK`
    (not overlapped: the copies run on the compute stream)."""
    base = "stock" if plan.startswith("stock") else "lightning-lowmem (defaults)"
    if plan == base:
        return "-"
    base_flops = flops[base].at(tokens)
    recompute = flops[plan].at(tokens) / base_flops - 1
    transfer = moved_bytes / HOST_LINK / (base_flops / DEVICE_FLOPS)
    parts = f"recompute +{100 * recompute:.0f}%" + (f", transfer +{100 * transfer:.0f}%" if transfer else "")
    return f"+{100 * (recompute + transfer):.0f}% ({parts})"


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
        flops = {name: step for name, (_, step) in measured.items()}
        for name, (memory, _) in measured.items():
            lengths = [memory.max_length(budget * GIB) for budget in BUDGETS_GIB]
            host = 2 * config.hidden * config.layers if PLANS[name][1] else 0
            rows.append([
                "Llama-3.1-8B" if row.model == "Llama-3-8B" else row.model, row.recipe, name,
                *(f"{length:,}" for length in lengths), f"{memory.static_bytes / GIB:.2f} GiB",
                f"{memory.per_token / 1024:.1f} KiB", overhead(name, flops, lengths[0], 2 * host * lengths[0]),
                f"{host / 1024:.0f} KiB ({host * lengths[0] / GIB:.0f} GiB at {lengths[0]:,})" if host else "-",
            ])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    header = [
        "model (batch 1)", "recipe", "plan", f"max tokens, {BUDGETS_GIB[0]} GiB", f"max tokens, {BUDGETS_GIB[1]} GiB",
        "fixed (weights, state, constant activations)", "per token (device)",
        f"predicted step time, at {BUDGETS_GIB[0]} GiB's length", "host memory per token (at 24 GiB's length)",
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
    warn_if_busy()
    quiet()
    if args.timing:
        body = timing(args.smoke)
        print(body)
        if not args.smoke:
            section = "## Long context: what each rung of the ladder costs (CPU)\n\n" + body
            write_section("ladder_timing", section, "python benchmarks/long_context.py --timing")
        return
    body = table(2 * MEASURED_TILE if args.smoke else args.tokens, args.smoke)
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
    "column): the device's activations are then one block's recompute and do not grow with the depth. Predicted step "
    "time: the training step's FLOPs (counted at 128, 256 and 512 tokens, recomputes included, attention's quadratic "
    "term too: torch's count of every query against every key) at the 24 GiB length, over the same model's without recompute, "
    "at 400 TFLOP/s, plus the checkpoints' trip to the host and back at 25 GB/s, not overlapped. Measured on "
    "this CPU (the profiler's allocation events): a GPU's context, kernels' workspace and fragmentation are not "
    "counted; leave room for them. Memory only: LLaMA-2's RoPE was trained to 4,096 positions. Unsloth's README, for "
    "comparison: Llama-3.1-8B QLoRA r=32 on 24 GB, 78,475 tokens (Hugging Face + FlashAttention-2: 5,789); 342,733 "
    "on 80 GB."
)


def write_sections(body: str) -> None:
    """RESULTS.md's "long context" section and the long-context guide's."""
    section = "## Long context: the longest sequence one GPU trains, predicted\n\n" + EXPLANATION + "\n\n" + body
    command = "python benchmarks/long_context.py"
    write_section("long_context", section, command)
    write_section(
        "long_context",
        section.replace("## Long context", "### Long context"),
        command,
        DOCS / "guides" / "long-context.md",
    )


if __name__ == "__main__":
    main()
