"""Model surgery benchmark: saved-for-backward bytes and step time, stock vs ``apply_lowmem``.

timm vit_small_patch16_224 (batch 4) in three fine-tuning settings (full, peft LoRA r=4 on
qkv, LoRA on qkv/proj/fc1/fc2) under bf16 autocast and fp32, and a small LlamaForCausalLM
with LoRA on every linear layer. Memory is the bytes one forward saves for backward, measured with
SavedTensorMeter (parameters excluded); time is a whole training step (forward, backward,
AdamW step), interleaved with the stock model in the same process.

    python benchmarks/surgery.py [--quick]
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

from benchmarks.common import interleaved_median, markdown_table, write_section
from lightning_lowmem import kernels
from lightning_lowmem.memory import MIB, SavedTensorMeter
from lightning_lowmem.surgery import apply_lowmem

VIT_LORA = {"LoRA on qkv only": ["qkv"], "LoRA on qkv, proj, fc1, fc2": ["qkv", "proj", "fc1", "fc2"]}
LLAMA_LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora(model: nn.Module, targets: list[str]) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))


def vit(setting: str) -> nn.Module:
    import timm

    model = timm.create_model("vit_small_patch16_224", pretrained=False)
    return lora(model, VIT_LORA[setting]) if setting in VIT_LORA else model


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
    )  # fmt: skip
    return lora(LlamaForCausalLM(config), LLAMA_LORA)


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
    build: Callable[[], nn.Module], batch: torch.Tensor, autocast: bool, repeats: int
) -> tuple[int, int, float | None]:
    torch.manual_seed(0)
    stock = build().train()
    converted = copy.deepcopy(stock)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        apply_lowmem(converted, example_input=batch, measure=False)
    before, after = saved_bytes(stock, batch, autocast), saved_bytes(converted, batch, autocast)
    if not repeats:
        return before, after, None
    times = interleaved_median(
        {"stock": step_fn(stock, batch, autocast), "lowmem": step_fn(converted, batch, autocast)},
        repeats=repeats, warmup=1,
    )  # fmt: skip
    return before, after, times["lowmem"] / times["stock"]


def cases(image: torch.Tensor, tokens: torch.Tensor):
    """(model, setting, build, batch) for every row; fp32 first, it is the faster one on CPU."""
    for autocast in (False, True):
        for setting in ("full fine-tuning", *VIT_LORA):
            yield "vit_small_patch16_224", setting, autocast, lambda setting=setting: vit(setting), image
        yield "Llama (4 layers, d=256), seq 256", "LoRA on all linears", autocast, llama, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer timing repeats")
    parser.add_argument("--time-rows", type=int, default=None, help="time only the first N rows (slow CPUs)")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    header = ["model (batch 4)", "setting", "precision", "stock MiB", "lowmem MiB", "reduction", "step time ratio"]
    rows = []
    image, tokens = torch.randn(4, 3, 224, 224), torch.randint(0, 1024, (4, 256))
    for row, (model, setting, autocast, build, batch) in enumerate(cases(image, tokens)):
        timed = args.time_rows is None or row < args.time_rows
        before, after, ratio = compare(build, batch, autocast, repeats if timed else 0)
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
                "not timed" if ratio is None else f"{ratio:.2f}",
            ]
        )
        print(rows[-1], flush=True)
        body = (  # written after every row: a long CPU run keeps what it measured
            "## Model surgery (`apply_lowmem`)\n\n"
            "Saved-for-backward bytes of one training forward (SavedTensorMeter, parameters excluded), "
            "stock model vs the same model after `apply_lowmem` (ReGELU2/ReSiLU2, memory-sharing norms "
            "with the affine applied by the consumer linears, weights recast in backward, LLaMA's gated "
            "MLPs fused). LoRA: peft "
            "r=4, dropout 0. Step time ratio: whole training step (forward, backward, AdamW), lowmem / "
            f"stock, interleaved median of {repeats} in the same process (CPU: indicative only); "
            f"kernel backend `{kernels.backend()}`.\n\n" + markdown_table(header, rows)
        )
        write_section("surgery", body, " ".join(["python benchmarks/surgery.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
