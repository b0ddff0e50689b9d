"""What dropout costs in activation memory, stock and with lightning-lowmem: the same model with dropout off and on.

LoRA with ``lora_dropout`` (peft keeps a dropped copy of the input per adapted layer, and every dropout its
mask) and models' hidden dropout (BERT, GPT-2, T5; attention dropout 0). Saved-for-backward bytes of one
training forward (SavedTensorMeter, CPU; autocast's weight copies apart): deterministic, so no timing and no
quiet machine needed. Writes the "dropout" section of RESULTS.md and the table of docs/how-it-works.md.

    python benchmarks/dropout.py [--smoke]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import zoo
from benchmarks.common import markdown_table, write_section
from lightning_lowmem import apply_lowmem

HOW_IT_WORKS = Path(__file__).resolve().parents[1] / "docs" / "how-it-works.md"


def lora_llama(dropout: float, smoke: bool) -> tuple[nn.Module, torch.Tensor]:
    """LLaMA geometry at hidden 256 (2 layers, SwiGLU 688), peft LoRA r=8 on every linear layer, 2 x 128 tokens."""
    shape = {"hidden_size": 64, "intermediate_size": 160} if smoke else {"hidden_size": 256, "intermediate_size": 688}
    model = zoo.llama(
        **shape, num_attention_heads=4, num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256
    )
    model = zoo.lora(model, zoo.LLAMA_LINEARS, r=8, lora_alpha=16, lora_dropout=dropout)
    return model, torch.randint(0, 1024, (2, 16 if smoke else 128))


def activation_bytes(build: Callable[[], tuple[nn.Module, object]], autocast: bool) -> tuple[int, int]:
    """Activation bytes of one training forward, stock and converted (the same built model)."""
    torch.manual_seed(0)
    model, example = build()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        report = apply_lowmem(model, example_input=example)
    return report.activation_bytes_before, report.activation_bytes_after


def cases(smoke: bool):
    """(model, recipe, autocast, build(p), p on, unit) for every row."""
    llama = "LLaMA (2 layers, d=256), 2 x 128 tokens" if not smoke else "LLaMA (2 layers, d=64), 2 x 16 tokens"
    for p in (0.05, 0.1):
        yield llama, f"LoRA r=8 all linears, bf16 autocast, `lora_dropout` {p}", True, lambda q: lora_llama(q, smoke), p
    for family, recipe in (("bert", "hidden dropout"), ("gpt2", "resid/embd dropout"), ("t5", "hidden dropout")):
        name = {"bert": "BERT", "gpt2": "GPT-2", "t5": "T5"}[family] + " (2 layers, d=64), 2 x 16 tokens"
        yield name, f"{recipe} 0.1 (attention 0)", False, lambda q, family=family: zoo.hidden_dropout(family, q), 0.1


def size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.0f} KiB"


def change(before: int, after: int) -> str:
    return f"{size(before)} -> {size(after)} ({100 * (after / before - 1):+.{2 if abs(after / before - 1) < 0.01 else 0}f}%)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny LLaMA, no RESULTS.md or docs update")
    args = parser.parse_args()
    rows = []
    for model, recipe, autocast, build, p in cases(args.smoke):
        (stock_off, ours_off), (stock_on, ours_on) = (
            activation_bytes(lambda q=q, build=build: build(q), autocast) for q in (0.0, p)
        )
        rows.append([model, recipe, change(stock_off, stock_on), change(ours_off, ours_on)])
        print(" | ".join(rows[-1]), flush=True)
    header = ["model (random init)", "recipe", "stock: dropout off -> on", "lightning-lowmem: dropout off -> on"]
    table = markdown_table(header, rows)
    print(table)
    if args.smoke:
        return
    intro = (
        "Activation bytes of one training forward (saved for backward, CPU, autocast's weight copies apart) of "
        "the same model with dropout off and on. Stock dropout keeps its mask, counted as a GPU keeps it (a bool per "
        "element, `torch.native_dropout`'s: CPU's own `F.dropout` keeps fp32 noise) and peft's LoRA a dropped copy of the input per adapted layer; here a seeded dropout "
        "keeps a seed, LoRA dropouts fold into their `lora_A`, and the norms stay shared.\n\n"
    )
    write_section("dropout", "## Dropout: what it costs\n\n" + intro + table, "python benchmarks/dropout.py")
    write_section(
        "dropout", "#### What dropout costs\n\n" + intro + table, "python benchmarks/dropout.py", HOW_IT_WORKS
    )


if __name__ == "__main__":
    main()
