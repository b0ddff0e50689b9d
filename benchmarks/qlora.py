"""QLoRA: what a training forward keeps for backward, stock QLoRA vs lightning-lowmem.

The paper's QLoRA LLaMA setting (LoRA r=64 on all linear layers, frozen nf4 base, bf16 compute and
autocast) at a small shape: a random LLaMA (2 layers, hidden 512, intermediate 1376, 8 heads) quantized
by transformers' BitsAndBytesConfig, prepared with peft's ``prepare_model_for_kbit_training``. Also
LLM.int8 (``Linear8bitLt``), whose autograd function keeps its input as a ``ctx`` attribute, outside
saved-tensor hooks: "held" counts those too (bitsandbytes' 4-bit function keeps only the weight).
Memory only, deterministic; bitsandbytes >= 0.46 runs on CPU.

    python benchmarks/qlora.py            # about a minute on 2 CPU cores
    python benchmarks/qlora.py --smoke    # tiny shapes, no RESULTS.md update
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_section
from lightning_lowmem import apply_lowmem
from lightning_lowmem.memory import MIB, SavedTensorMeter

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = {  # apply_lowmem options; None: stock QLoRA
    "stock QLoRA": None,
    "ReSiLU2 + MS-RMSNorm (the paper's)": {"gated": False, "linear": False},
    "lightning-lowmem (fused SwiGLU + MS-RMSNorm + recast)": {},
}


def bf16() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def qlora_llama(
    directory: str | Path, hidden: int, intermediate: int, heads: int, layers: int = 2, rank: int = 8,
    bits: int = 4, targets: list[str] = ALL_LINEARS, dropout: float = 0.0,
) -> nn.Module:  # fmt: skip
    """A random LLaMA loaded the QLoRA way: quantized by transformers' BitsAndBytesConfig (nf4 with bf16 compute,
    or int8), prepared for k-bit training (norms, embeddings and head in fp32), LoRA on ``targets`` with a random
    B (so LoRA changes the function)."""
    import peft
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=1024,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    if bits == 4:
        quantization = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
    elif bits == 8:
        quantization = transformers.BitsAndBytesConfig(load_in_8bit=True)
    else:
        raise ValueError(f"qlora_llama: bits must be 4 or 8, got {bits!r}")
    model = transformers.LlamaForCausalLM.from_pretrained(directory, quantization_config=quantization, device_map="cpu")
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=rank, lora_alpha=16, lora_dropout=dropout, target_modules=targets)
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.02)
    return model


def held_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes a training forward (bf16 autocast) keeps for backward: tensors saved through autograd, and those
    bitsandbytes' autograd functions keep as ``ctx`` attributes, which saved-tensor hooks (and so SavedTensorMeter)
    never see. Each storage once; parameters and buffers excluded."""
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.train()
    with bf16(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = model(x).logits
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for value in getattr(node, "__dict__", {}).values():  # a Python autograd function's ctx
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    keep(t)
        stack.extend(next_node for next_node, _ in node.next_functions)
    parameters = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    return sum(nbytes for ptr, nbytes in storages.items() if ptr not in parameters)


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    model.train()
    with bf16(), SavedTensorMeter(model) as meter:
        model(x)
    return meter.total_bytes


def rows_for(bits: int, shape: dict[str, int], rank: int, x: torch.Tensor) -> list[list[str]]:
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        stock = qlora_llama(directory, rank=rank, bits=bits, **shape)
    rows, base = [], None
    for name, options in VARIANTS.items():
        model = stock if options is None else copy.deepcopy(stock)
        if options is not None:
            with bf16():
                apply_lowmem(model, example_input=x, measure=False, **options)
        saved, held = saved_bytes(model, x), held_bytes(model, x)
        base = base or (saved, held)
        rows.append([
            "nf4" if bits == 4 else "int8", name, f"{saved / MIB:.2f} ({100 * (saved / base[0] - 1):+.0f}%)",
            f"{held / MIB:.2f} ({100 * (held / base[1] - 1):+.0f}%)",
        ])  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no RESULTS.md update")
    args = parser.parse_args()
    shape = (
        {"hidden": 64, "intermediate": 172, "heads": 4}
        if args.smoke
        else {"hidden": 512, "intermediate": 1376, "heads": 8}
    )
    rank, (batch, seq) = (8, (2, 16)) if args.smoke else (64, (2, 256))
    x = torch.randint(0, 128, (batch, seq))
    # bitsandbytes' int8 CPU path logs its fp16 cast on every call
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    rows = rows_for(4, shape, rank, x) + rows_for(8, shape, rank, x)
    header = ["base", "variant", "saved MiB (SavedTensorMeter)", "held MiB (incl. bitsandbytes ctx)"]
    table = markdown_table(header, rows)
    print(table)
    if args.smoke:
        return
    body = (
        "## QLoRA: LLaMA, LoRA r=64 on all linear layers, bf16 autocast\n\n"
        f"A random LLaMA, 2 layers, hidden {shape['hidden']}, intermediate {shape['intermediate']}, "
        f"{shape['heads']} heads ({shape['heads'] // 2} KV heads), batch {batch} x {seq} tokens, quantized by "
        "transformers' `BitsAndBytesConfig` (nf4 with bf16 compute, or LLM.int8), `prepare_model_for_kbit_training`, "
        f'peft LoRA r={rank} on every linear layer. What one training forward keeps for backward; "held" also '
        "counts the tensors bitsandbytes' autograd functions keep as `ctx` attributes (int8 keeps its input; "
        "nf4 only its weight), which saved-tensor hooks do not see. Where the stock bytes come from: "
        "`prepare_model_for_kbit_training` keeps the norms in fp32, so under autocast each LoRA A adapter saves its own "
        "bf16 copy of a norm's output, and bitsandbytes' layers return their input's dtype, so the MLP's gate and up "
        "stay fp32; a memory-sharing norm returns the compute dtype and its LoRA A adapters save its one `z`.\n\n"
        + table
    )
    write_section("qlora", body, "python benchmarks/qlora.py")


if __name__ == "__main__":
    main()
