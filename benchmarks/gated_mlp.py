"""Gated MLPs (SwiGLU): saved bytes per token, gradient fidelity and time of the fused product.

One LLaMA MLP at 7B shape (hidden 4096, intermediate 11008) with peft LoRA (r=8) on gate, up
and down, under bf16 autocast, in four variants: stock; the paper's ReSiLU2 swapped in alone;
the fused product saving gate and up (what Liger Kernel's fused SwiGLU saves); the fused
product in its automatic mode (gate, plus the product the LoRA-adapted down projection saves
anyway). Memory is the marginal saved-for-backward bytes per token per intermediate element:
the slope between two sequence lengths (SavedTensorMeter), so constants drop out. Fidelity:
cosine similarity of every gradient (LoRA weights and the input) with the stock model's in
fp32. Time: forward+backward of a whole MLP, fused vs stock, interleaved in one process.

    python benchmarks/gated_mlp.py            # ~10 minutes on 2 CPU cores
    python benchmarks/gated_mlp.py --smoke    # tiny shapes, no RESULTS.md update
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import interleaved_median, markdown_table, write_section
from lightning_lowmem import apply_lowmem, kernels
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.nn import GatedMLPBase

RANK = 8
VARIANTS = ("stock", "ReSiLU2 only", "fused, saves gate and up", "fused, auto (lightning-lowmem)")


class MLPOnly(nn.Module):
    """A LLaMA MLP as a model of its own (peft needs a parent to adapt)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP

        self.mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def variants(hidden: int, intermediate: int, lora: bool) -> dict[str, nn.Module]:
    """The four variants over the same weights; LoRA B random (not zero) so every gradient is nonzero."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    stock = MLPOnly(hidden, intermediate)
    if lora:
        config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["gate_proj", "up_proj", "down_proj"],
                            init_lora_weights=False)  # fmt: skip
        stock = get_peft_model(stock, config)
    models = {name: copy.deepcopy(stock) for name in VARIANTS[1:]}
    apply_lowmem(models["ReSiLU2 only"], norm=False, gated=False)
    apply_lowmem(models["fused, saves gate and up"], norm=False)
    apply_lowmem(models["fused, auto (lightning-lowmem)"], norm=False)
    for module in models["fused, saves gate and up"].modules():
        if isinstance(module, GatedMLPBase):
            module.mode = "gate_up"
    return {"stock": stock, **models}


def bytes_per_token_per_element(model: nn.Module, hidden: int, intermediate: int, tokens: tuple[int, int]) -> float:
    totals = []
    for length in tokens:
        x = torch.randn(1, length, hidden, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), SavedTensorMeter(model) as meter:
            model(x)
        totals.append(meter.total_bytes)
    return (totals[1] - totals[0]) / (tokens[1] - tokens[0]) / intermediate


def gradients(model: nn.Module, x: torch.Tensor, autocast: bool) -> torch.Tensor:
    """Every trainable gradient and the input gradient, concatenated (fp32)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x).float().square().mean()
    loss.backward()
    grads = [p.grad.float().flatten() for p in model.parameters() if p.grad is not None]
    return torch.cat([*grads, x.grad.float().flatten()])


def fwd_bwd(model: nn.Module, x: torch.Tensor, autocast: bool):
    def run() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        out.float().square().mean().backward()

    return run


def product_only(kind: str, mode: str | None, shape: tuple[int, ...], dtype: torch.dtype):
    """Forward+backward of act(gate) * up alone: stock (mode None) or the fused op."""
    from lightning_lowmem.functional import gated_activation

    gate = torch.randn(shape, dtype=dtype, requires_grad=True)
    up = torch.randn(shape, dtype=dtype, requires_grad=True)
    grad = torch.randn(shape, dtype=dtype)

    def run() -> None:
        out = F.silu(gate) * up if mode is None else gated_activation(gate, up, kind, mode)
        out.backward(grad)
        gate.grad = up.grad = None

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    hidden, intermediate = (64, 172) if args.smoke else (4096, 11008)
    repeats = 1 if args.smoke else args.repeats

    models = variants(hidden, intermediate, lora=True)
    x = torch.randn(1, 16 if args.smoke else 32, hidden)
    exact = gradients(models["stock"], x, autocast=False)
    memory_rows = []
    for name, model in models.items():
        per_element = bytes_per_token_per_element(model, hidden, intermediate, (16, 32) if args.smoke else (32, 64))
        cosine = F.cosine_similarity(gradients(model, x, autocast=True).double(), exact.double(), dim=0).item()
        memory_rows.append([name, f"{per_element:.3f}", f"{8 * per_element:.1f}", f"{cosine:.5f}"])
        print(" | ".join(memory_rows[-1]), flush=True)
    formula = (4 * intermediate + 2 * hidden + 3 * 2 * RANK) / intermediate
    del models

    # time: a whole MLP at a CPU-sized shape, fp32 full fine-tuning and bf16 autocast with LoRA
    time_rows = []
    shape_hidden, shape_intermediate = (64, 172) if args.smoke else (1024, 2816)
    for label, lora, autocast, tokens in (
        ("fp32, full fine-tuning", False, False, 16 if args.smoke else 512),
        ("bf16 autocast, LoRA r=8", True, True, 16 if args.smoke else 128),
    ):
        pair = variants(shape_hidden, shape_intermediate, lora)
        x = torch.randn(1, tokens, shape_hidden)
        fused = copy.deepcopy(pair["stock"])
        apply_lowmem(fused, activation=False, norm=False, linear=False)  # the product alone changes
        fns = {"stock": fwd_bwd(pair["stock"], x, autocast), "fused": fwd_bwd(fused, x, autocast)}
        times = interleaved_median(fns, repeats=repeats, warmup=1)
        ratio = times["fused"] / times["stock"]
        time_rows.append([f"MLP {shape_hidden}->{shape_intermediate}, {tokens} tokens, {label}", f"{ratio:.2f}"])
        print(" | ".join(time_rows[-1]), flush=True)
    elementwise = (8, 128, 2816) if not args.smoke else (2, 8, 64)
    for dtype in (torch.float32, torch.bfloat16):
        fns = {mode or "stock": product_only("silu", mode, elementwise, dtype) for mode in (None, "gate_up", "gate")}
        times = interleaved_median(fns, repeats=repeats * 3, warmup=2)
        for mode in ("gate_up", "gate"):
            label = (
                f"silu(gate) * up alone, {'x'.join(map(str, elementwise))} {str(dtype).removeprefix('torch.')}, {mode}"
            )
            time_rows.append([label, f"{times[mode] / times['stock']:.2f}"])
            print(" | ".join(time_rows[-1]), flush=True)

    tables = (
        markdown_table(["variant", "saved bytes / token / intermediate element", "bits", "gradient cosine vs fp32"],
                       memory_rows)
        + "\n\n"
        + markdown_table(["forward+backward, fused vs stock", "time ratio"], time_rows)
    )  # fmt: skip
    print(tables)
    if not args.smoke:
        body = (
            "## Gated MLPs: the fused SwiGLU product\n\n"
            f"One LLaMA MLP at 7B shape (hidden {hidden}, intermediate {intermediate}), peft LoRA r={RANK} on gate, "
            "up and down (B initialised randomly), bf16 autocast, fp32 input. Saved bytes: slope between 32 and "
            "64 tokens. The formula for the automatic mode, gate + product (shared with down's LoRA A) + one "
            f"bf16 copy of x + three rank-r adapter activations, gives {formula:.3f}. Gradient cosine: every LoRA "
            "and input gradient under bf16 autocast against the stock model in fp32 on 32 tokens (the stock "
            "row is bf16 rounding alone). Time: the MLP with only its product fused (nothing else converted) "
            "against the stock MLP, interleaved median of "
            f"{repeats} (product alone: {3 * repeats}), kernel backend `{kernels.backend()}`.\n\n" + tables
        )
        write_section("gated_mlp", body, "python benchmarks/gated_mlp.py")


if __name__ == "__main__":
    main()
