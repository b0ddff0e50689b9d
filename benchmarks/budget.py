"""Activation-memory budgets: the low-memory model under a budget against checkpointing the stock model.

timm vit_small_patch16_224, batch 4, fp32, full fine-tuning. Rows: the stock model; the stock model
with every block checkpointed (what users do today to save memory: the anchor); the low-memory
model without a budget and at budgets of 60% and 30% of its own activation bytes. Memory is what
a training step holds for backward: the bytes one forward saves (SavedTensorMeter) plus, where
blocks are checkpointed, the largest one recomputed in backward. Time is forward + backward,
interleaved with the stock model in one process (ratio to stock, median). The claim to show:
the same memory as full checkpointing for less recomputation.

    python -m benchmarks.budget [--smoke] [--repeats N]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import zoo
from benchmarks.common import interleaved_median, markdown_table, write_section
from lightning_lowmem import apply_lowmem
from lightning_lowmem.memory import MIB
from lightning_lowmem.surgery.budget import BudgetPlan, checkpoint_block, find_blocks, measure_blocks
from lightning_lowmem.surgery.convert import Surgery
from lightning_lowmem.surgery.measure import measure_saved

BUDGETS = (0.6, 0.3)


def vit(smoke: bool) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if smoke:
        return zoo.vit("vit_small_patch16_224", tiny=False, img_size=32, patch_size=8, depth=6), zoo.images(2)
    return zoo.vit("vit_small_patch16_224", tiny=False), zoo.images(4, 224)


def checkpoint_every_block(model: nn.Module, example: torch.Tensor) -> BudgetPlan:
    """The anchor: every block of the stock model checkpointed."""
    names = find_blocks(model)
    blocks, _, total_flops = measure_blocks(model, example, names)
    surgery = Surgery(model)
    for name in names:
        checkpoint_block(surgery, model.get_submodule(name))
    plan = BudgetPlan(budget_bytes=0, blocks=blocks, checkpointed=names)
    plan.forward_bytes = measure_saved(model, example).total_bytes
    plan.recompute_bytes = max(b.own_bytes for b in blocks)
    plan.recomputed_flops, plan.forward_flops = sum(b.flops for b in blocks), total_flops
    return plan


def step(model: nn.Module, example: torch.Tensor):
    def run() -> None:
        model(example).square().mean().backward()
        model.zero_grad(set_to_none=True)

    return run


def budgeted(model: nn.Module, example: torch.Tensor, budget_mib: float, convert: bool) -> tuple[str, str, str] | None:
    """Fit ``budget_mib``, with the low-memory conversion or (``convert=False``) by checkpointing alone:
    (activation MiB, blocks checkpointed, FLOPs recomputed), or ``None`` when it cannot be met."""
    off = {} if convert else {"activation": False, "norm": False, "linear": False, "gated": False}
    try:
        plan = apply_lowmem(model, example_input=example, budget_mib=budget_mib, **off).budget
    except ValueError:
        return None
    return f"{plan.measured_bytes / MIB:.1f}", str(len(plan.checkpointed)), f"{100 * plan.recompute_fraction:.0f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a 6-block ViT at 32 px, one repeat, no RESULTS.md")
    args = parser.parse_args()
    stock, example = vit(args.smoke)
    stock.train()
    stock_mib = measure_saved(stock, example).total_bytes / MIB
    anchor = copy.deepcopy(stock)
    plan = checkpoint_every_block(anchor, example)
    lowmem = copy.deepcopy(stock)
    need_mib = apply_lowmem(lowmem, example_input=example).saved_bytes_after / MIB
    rows: dict[str, tuple[nn.Module, tuple[str, str, str]]] = {
        "stock": (stock, (f"{stock_mib:.1f}", "0", "0%")),
        "stock, every block checkpointed (the anchor)": (
            anchor, (f"{plan.measured_bytes / MIB:.1f}", str(len(plan.checkpointed)), f"{100 * plan.recompute_fraction:.0f}%")
        ),
        "lightning-lowmem": (lowmem, (f"{need_mib:.1f}", "0", "0%")),
    }  # fmt: skip
    for fraction in BUDGETS[: 1 if args.smoke else None]:
        budget = fraction * need_mib
        for name, convert in (("lightning-lowmem", True), ("stock, checkpointing only", False)):
            model = copy.deepcopy(stock)
            result = budgeted(model, example, budget, convert)
            label = f"{name}, budget {budget:.1f} MiB ({fraction:.0%} of lightning-lowmem's)"
            if result is not None:
                rows[label] = (model, result)
            else:
                print(f"{label}: cannot be met")
    times = interleaved_median(
        {row: step(model, example) for row, (model, _) in rows.items()}, repeats=1 if args.smoke else args.repeats
    )
    header = ["ViT-S, batch 4, fp32", "activation MiB", "blocks checkpointed", "FLOPs recomputed", "step time vs stock"]
    table = markdown_table(
        header, [[row, *result, f"{times[row] / times['stock']:.2f}"] for row, (_, result) in rows.items()]
    )
    print(table)
    if args.smoke:
        return
    body = (
        "### Activation-memory budgets (ViT-S)\n\n"
        "Activation MiB = bytes one forward saves for backward + the largest checkpointed block, recomputed in "
        "backward. A budget is fitted by `apply_lowmem(budget_mib=...)` on the converted model, or on the stock "
        "model with every conversion off (checkpointing alone, the same planner). Step time: forward + backward, "
        f"median of {args.repeats} interleaved runs, ratio to stock.\n\n" + table
    )
    write_section("budget", body, f"python -m benchmarks.budget --repeats {args.repeats}")


if __name__ == "__main__":
    main()
