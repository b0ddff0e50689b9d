"""Model surgery benchmark: saved-for-backward bytes and step time, stock vs ``apply_lowmem``.

timm vit_small_patch16_224 (batch 4) in three fine-tuning settings (full, peft LoRA r=4 on
qkv, LoRA on qkv/proj/fc1/fc2) under bf16 autocast and fp32, and a small LlamaForCausalLM
with LoRA on every linear layer. Memory is the bytes one forward saves for backward, measured with
SavedTensorMeter (parameters excluded); time is a whole training step (forward, backward,
AdamW step), interleaved with the stock model in the same process.

``--zoo`` instead converts the tiny model of every family in ``benchmarks/zoo.py`` and writes what it
converted, what it left alone and why, and the memory saved (fp32) into the table of docs/how-it-works.md
"Which models convert what".

    python benchmarks/surgery.py [--quick | --smoke | --zoo]
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import zoo
from benchmarks.common import interleaved_times, markdown_table, paired_ratio, warn_if_busy, write_section
from benchmarks.zoo import FAMILIES, Family
from lightning_lowmem import kernels
from lightning_lowmem.memory import MIB, SavedTensorMeter
from lightning_lowmem.nn import LowMemLinear, LowMemTransposedLinear
from lightning_lowmem.nn.linear import shares_functional_linears
from lightning_lowmem.surgery import LowMemReport, apply_lowmem

HOW_IT_WORKS = Path(__file__).resolve().parents[1] / "docs" / "how-it-works.md"

VIT_LORA = {"LoRA on qkv only": ["qkv"], "LoRA on qkv, proj, fc1, fc2": ["qkv", "proj", "fc1", "fc2"]}


def vit(setting: str, img_size: int = 224) -> nn.Module:
    model = zoo.vit("vit_small_patch16_224", tiny=False, img_size=img_size)
    return zoo.lora(model, VIT_LORA[setting]) if setting in VIT_LORA else model


def llama(dropout: float = 0.0) -> nn.Module:
    model = zoo.llama(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
    )  # fmt: skip
    return zoo.lora(model, zoo.LLAMA_LINEARS, lora_dropout=dropout)


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    out = model(batch)
    logits = out.logits if hasattr(out, "logits") else out
    return logits.float().square().mean()


def saved_bytes(model: nn.Module, batch: torch.Tensor, autocast: bool) -> int:
    """Bytes saved for backward by one training forward (the graph is dropped, not run)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), SavedTensorMeter(model) as meter:
        loss_of(model, batch)
    return meter.total_bytes


def step_fn(model: nn.Module, batch: torch.Tensor, autocast: bool) -> Callable[[], None]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def compare(
    build: Callable[[], nn.Module], batch: torch.Tensor, autocast: bool, repeats: int, convert: bool = True
) -> tuple[int, int, tuple[float, float, float] | None]:
    """Saved bytes stock -> converted, and the step time ratio with its 95% interval
    (:func:`~benchmarks.common.paired_ratio`). Both models are copies of one built model (a copy's parameters lie
    differently in memory from a freshly initialised model's, which alone moves CPU step times by a few percent);
    ``convert=False`` times the stock model against its own copy: the noise floor of the ratio."""
    torch.manual_seed(0)
    built = build().train()
    stock, converted = copy.deepcopy(built), copy.deepcopy(built)
    if convert:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            apply_lowmem(converted, example_input=batch, measure=False)
    before, after = saved_bytes(stock, batch, autocast), saved_bytes(converted, batch, autocast)
    if not repeats:
        return before, after, None
    times = interleaved_times(
        {"stock": step_fn(stock, batch, autocast), "lowmem": step_fn(converted, batch, autocast)},
        repeats=repeats, warmup=1,
    )  # fmt: skip
    return before, after, paired_ratio(times["lowmem"], times["stock"])


NOISE_FLOOR = "stock vs its own copy (noise floor)"


def cases(image: torch.Tensor, tokens: torch.Tensor):
    """(model, setting, build, batch) for every row; fp32 first, it is the faster one on CPU; the noise floor
    (the stock model timed against itself) first of all."""
    side = image.shape[-1]
    yield "vit_small_patch16_224", NOISE_FLOOR, False, lambda: vit("full fine-tuning", side), image
    for autocast in (False, True):
        for setting in ("full fine-tuning", *VIT_LORA):
            yield "vit_small_patch16_224", setting, autocast, lambda setting=setting: vit(setting, side), image
        llama_name = f"Llama (4 layers, d=256), seq {tokens.shape[-1]}"
        yield llama_name, "LoRA on all linears", autocast, llama, tokens
        yield llama_name, "LoRA on all linears, lora_dropout 0.05", autocast, lambda: llama(0.05), tokens


def _count(report: LowMemReport, kind: str) -> str:
    converted = sum(e.kind == kind for e in report.converted)
    alone = sum(e.kind == kind and e.status == "left alone" for e in report.entries)
    return f"{converted}" + (f" of {converted + alone}" if alone else "")


def _consumers(stock: nn.Module, model: nn.Module) -> str:
    """The kinds of layer that share a norm's tensor: the stock class of each consumer, and F.linear callers."""
    kinds = set()
    for name, module in model.named_modules():
        if isinstance(module, (LowMemLinear, LowMemTransposedLinear)) and module.norm is not None:
            kinds.add(type(stock.get_submodule(name)).__name__)
        if shares_functional_linears(module):
            kinds.add(f"F.linear in {type(module).__name__}")
    return ", ".join(sorted(kinds))


def _left_alone(report: LowMemReport) -> str:
    """Each reason once, with the modules it holds for (layer numbers as N, module paths in it dropped)."""
    names: dict[str, set[str]] = {}
    for entry in report.left_alone:
        reason = re.sub(r"((?:in|by) [A-Z]\w*) [\w.]+\)", r"\1)", entry.detail)  # "... in Gemma2DecoderLayer)"
        name = re.sub(r"\.\d+\.", ".N.", entry.name)
        label = f"`{name}` {entry.was}" if entry.kind == "functional" else f"`{name}`"
        names.setdefault(reason, set()).add(label)
    return "; ".join(f"{', '.join(sorted(n))}: {why}" for why, n in names.items()) or "-"


def zoo_row(family: Family) -> list[str]:
    torch.manual_seed(0)
    stock = family.build().eval()
    model = copy.deepcopy(stock)
    report = apply_lowmem(model, example_input=family.example())
    before, after = report.saved_bytes_before / 1024, report.saved_bytes_after / 1024
    return [
        f"`{family.name}`",
        _count(report, "activation"),
        _count(report, "norm"),
        _consumers(stock, model) or "-",
        _count(report, "gated MLP"),
        f"{before:.0f} -> {after:.0f} (-{100 * report.reduction:.0f}%)",
        _left_alone(report),
    ]


def zoo_table() -> None:
    header = [
        "family", "activations", "norms", "norms shared with", "gated MLPs", "saved KiB (fp32)", "left alone (why)"
    ]  # fmt: skip
    rows = []
    for family in FAMILIES.values():
        rows.append(zoo_row(family))
        print(rows[-1], flush=True)
    body = (
        "### Which models convert what\n\n"
        "`apply_lowmem` on the tiny random-init model of each family in `benchmarks/zoo.py` (hidden size 64, "
        "two layers, or one encoder and one decoder layer; batch 2, 16 tokens or a 32x32 image; fp32, dropout "
        '0): the modules it converted ("4 of 5": one was left alone, the last column says why), the kinds of '
        "layer that share each norm's saved tensor, and the bytes one training forward saves for backward, "
        "stock -> converted (at full size the proportions shift with sequence length, vocabulary and width). "
        "Every row keeps the stock outputs and hidden states, the stock gradients (norms and fused MLPs are "
        "exact), and strict checkpoints both ways, as `tests/test_coverage.py` checks.\n\n"
        + markdown_table(header, rows)
    )
    write_section("zoo", body, "python benchmarks/surgery.py --zoo", HOW_IT_WORKS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer timing repeats")
    parser.add_argument("--time-rows", type=int, default=None, help="time only the first N rows (slow CPUs)")
    parser.add_argument("--zoo", action="store_true", help="the docs' table of every family in benchmarks/zoo.py")
    parser.add_argument("--smoke", action="store_true", help="32x32 images, 16 tokens, two rows timed once, no writes")
    args = parser.parse_args()
    warn_if_busy()
    if args.zoo:
        zoo_table()
        return
    repeats = 1 if args.smoke else 5 if args.quick else 30
    time_rows = 2 if args.smoke else args.time_rows
    side, seq = (32, 16) if args.smoke else (224, 256)
    header = [
        "model (batch 4)", "setting", "precision", "stock MiB", "lowmem MiB", "reduction", "step time ratio (95% interval)"
    ]  # fmt: skip
    rows = []
    image, tokens = torch.randn(4, 3, side, side), torch.randint(0, 1024, (4, seq))
    for row, (model, setting, autocast, build, batch) in enumerate(cases(image, tokens)):
        timed = time_rows is None or row < time_rows
        before, after, ratio = compare(build, batch, autocast, repeats if timed else 0, setting != NOISE_FLOOR)
        precision = "bf16 autocast" if autocast else "fp32"
        reduction = f"{100 * (1 - after / before):.1f}%"
        rows.append(
            [
                model,
                setting,
                precision,
                f"{before / MIB:.1f}",
                f"{after / MIB:.1f}",
                reduction,
                "not timed" if ratio is None else "{:.2f} ({:.2f}-{:.2f})".format(*ratio),
            ]
        )
        print(rows[-1], flush=True)
        body = (  # written after every row: a long CPU run keeps what it measured
            "## Model surgery (`apply_lowmem`)\n\n"
            "Saved-for-backward bytes of one training forward (SavedTensorMeter, parameters excluded), "
            "stock model vs the same model after `apply_lowmem` (ReGELU2/ReSiLU2, memory-sharing norms "
            "whose consumer linears save the norm's output, weights recast in backward, LLaMA's gated "
            "MLPs fused). LoRA: peft "
            "r=4, dropout 0 unless the row says otherwise; stock dropout masks counted as a GPU keeps them (1 B per "
            "element; the CPU's stock step still runs its own `F.dropout`, which keeps them in the input's dtype). "
            "Step time ratio: whole training step (forward, backward, AdamW), lowmem / "
            f"stock: the median of the per-round ratios of {repeats} rounds in the same process, the two models' "
            "steps in alternating order, both models copies of one; in brackets the ratio's 95% bootstrap "
            "interval, how far this machine's noise lets it be read. The first row times the stock model against "
            "its own copy: ratios within its distance from 1.00 are noise; "
            f"kernel backend `{kernels.backend()}`.\n\n" + markdown_table(header, rows)
        )
        if not args.smoke:
            write_section("surgery", body, " ".join(["python benchmarks/surgery.py", *sys.argv[1:]]))
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
