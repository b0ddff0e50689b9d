"""LitGPT next to Hugging Face: what lightning-lowmem saves on the same architecture from either library, and
what a LitGPT LoRA step costs in time.

Memory: saved-for-backward bytes of one training forward (``apply_lowmem``'s report, CPU), LitGPT's
``litgpt.lora.GPT`` and the Hugging Face + peft twin of the same sizes (``zoo.hf_twin``): hidden 256 in 4 heads,
2 layers, the architecture's MLP, vocabulary 1024, 2 x 64 tokens, bf16 weights under bf16 autocast, LoRA r=8 on
every linear layer and the head (``lora_dropout`` 0 and 0.05), and full fine-tuning. Deterministic: no quiet
machine needed. Time: a LitGPT LoRA training step (forward, backward, AdamW), stock and converted, timed in
alternation (quiet machine). Writes the "litgpt" section of RESULTS.md.

    python benchmarks/litgpt_vs_hf.py [--smoke] [--repeats 10]
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import zoo
from benchmarks.common import interleaved_times, markdown_table, paired_ratio, warn_if_busy, write_section
from lightning_lowmem import apply_lowmem

SIZES = {"n_embd": 256, "n_head": 4, "n_query_groups": 4, "head_size": 64, "padded_vocab_size": 1024}
SMOKE = {"n_embd": 64, "n_head": 4, "n_query_groups": 4, "head_size": 16, "padded_vocab_size": 128}


def sizes(name: str, smoke: bool) -> dict[str, int]:
    """The benchmark's sizes with the architecture's own MLP ratio."""
    import litgpt

    real, chosen = litgpt.Config.from_name(name), dict(SMOKE if smoke else SIZES)
    chosen["intermediate_size"] = round(real.intermediate_size / real.n_embd * chosen["n_embd"])
    return chosen


def measured(model: nn.Module, example: object) -> tuple[int, int]:
    """Saved bytes of one training forward, stock and converted (bf16 weights, bf16 autocast)."""
    model = model.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = apply_lowmem(model, example_input=example)
    return report.saved_bytes_before, report.saved_bytes_after


def cell(before: int, after: int) -> str:
    return f"{before / 2**20:.2f} -> {after / 2**20:.2f} MiB ({100 * (after / before - 1):+.1f}%)"


def memory_rows(smoke: bool, tokens: torch.Tensor) -> list[list[str]]:
    rows = []
    for name in zoo.LITGPT_TWINS:
        for recipe, lora in (("LoRA r=8, dropout 0", {"lora_dropout": 0.0}), ("LoRA r=8, dropout 0.05", {"lora_dropout": 0.05}), ("full fine-tuning", None)):  # fmt: skip
            overrides = {**sizes(name, smoke), **({"lora_r": 8, "lora_alpha": 16, **lora} if lora else {})}
            torch.manual_seed(0)
            ours = measured(zoo.litgpt_model(name, lora=lora is not None, **overrides), tokens)
            torch.manual_seed(0)
            twin = zoo.hf_twin(name, lora=lora is not None, **overrides)
            theirs = measured(twin, {"input_ids": tokens, "use_cache": False})
            rows.append([name, recipe, cell(*ours), cell(*theirs)])
            print(" | ".join(rows[-1]), flush=True)
    return rows


def lora_step(model: nn.Module, tokens: torch.Tensor) -> Callable[[], None]:
    """One LitGPT LoRA training step as ``litgpt finetune lora`` takes it (bf16-true, AdamW on the adapters)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def step_time(smoke: bool, repeats: int) -> tuple[str, str]:
    """The converted LitGPT LLaMA-2 LoRA step's time over stock's, paired per round, and what was timed."""
    torch.manual_seed(0)
    stock = zoo.litgpt_model("Llama-2-7b-hf", lora=True, lora_dropout=0.05, **sizes("Llama-2-7b-hf", smoke))
    stock = stock.to(torch.bfloat16).train()
    ours = copy.deepcopy(stock)
    length = 32 if smoke else 512
    tokens = torch.randint(0, SIZES["padded_vocab_size"] if not smoke else 128, (2, length + 1))
    apply_lowmem(ours, example_input=tokens[:, :-1])
    times = interleaved_times({"stock": lora_step(stock, tokens), "ours": lora_step(ours, tokens)}, repeats, 2)
    ratio, low, high = paired_ratio(times["ours"], times["stock"])
    what = f"LitGPT Llama-2 LoRA r=8 (dropout 0.05) step, bf16, 2 x {length} tokens"
    return what, f"{ratio:.2f}x stock (95% interval {low:.2f}-{high:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, no RESULTS.md update")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    warn_if_busy()
    tokens = torch.randint(0, 128 if args.smoke else SIZES["padded_vocab_size"], (2, 16 if args.smoke else 64))
    header = ["architecture", "recipe", "LitGPT: stock -> lightning-lowmem", "Hugging Face (+ peft): stock -> lightning-lowmem"]  # fmt: skip
    table = markdown_table(header, memory_rows(args.smoke, tokens))
    what, ratio = step_time(args.smoke, 2 if args.smoke else args.repeats)
    print(table)
    print(f"{what}: {ratio}")
    if args.smoke:
        return
    body = (
        "## LitGPT next to Hugging Face\n\n"
        "Saved-for-backward bytes of one training forward (CPU), the same architecture from LitGPT "
        "(`litgpt.lora.GPT` / `litgpt.GPT`) and from Hugging Face (+ peft), hidden 256, 2 layers, vocabulary 1024, "
        "2 x 64 tokens, bf16 weights under bf16 autocast, LoRA r=8 on every linear layer and the head. LitGPT's "
        "stock attention keeps its whole `qkv` output alive (SDPA saves `v`, a view of it) and a copy of its output "
        "for `proj`; its fused `qkv` keeps one dropped copy where peft keeps three. Stock dropout masks counted as a "
        "GPU keeps them (1 B per element).\n\n"
        f"{table}\n\nTime: {what}, timed in alternation with stock's ({args.repeats} rounds): {ratio}."
    )
    write_section("litgpt", body, f"python benchmarks/litgpt_vs_hf.py --repeats {args.repeats}")


if __name__ == "__main__":
    main()
