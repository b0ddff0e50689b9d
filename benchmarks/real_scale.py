"""What a user saves on the model they fine-tune: activation bytes per token at full depth, real configs.

Each model is built at its real hidden size, intermediate size, heads and vocabulary (dims written out
below from the public Hugging Face / timm configs; random init, nothing downloaded) with 1 and with 2
decoder layers. Activation memory is linear in depth, so one layer's share is the difference of the two
and the full model's activations are ``rest + depth * per_layer`` (``rest``: embedding, final norm, head
and loss, the 1-layer figure less one layer); the run prints both layers' own bytes of the 2-layer model
as the check. Bytes are what one training forward (bf16 weights, ``torch.autocast("cpu", torch.bfloat16)``)
saves for backward, as ``apply_lowmem``'s report measures them, less autocast's weight copies (they do not
grow with the tokens and are listed apart), divided by the tokens (images for ViT). Causal LMs get
``labels``, so the loss is part of the forward (stock: fp32 logits; ours: the fused head).

Columns: stock; the paper's variant (its two ops alone: ReSiLU2/ReGELU2 + MS-norm, everything else off);
lightning-lowmem (defaults); and lightning-lowmem with every block checkpointed (the smallest activation
budget ``apply_lowmem(budget_mib=...)`` can meet: each block keeps its input, plus one block recomputed).

    python benchmarks/real_scale.py            # every model and recipe (~10 minutes on 2 CPU cores)
    python benchmarks/real_scale.py --quick    # a subset, no RESULTS.md update
    python benchmarks/real_scale.py --lengths  # per-token bytes at 128, 256 and 512 tokens (the length check)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_section
from lightning_lowmem import TrainingMemory, training_memory
from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.surgery.apply import run
from lightning_lowmem.surgery.budget import checkpoint_block, find_blocks
from lightning_lowmem.surgery.convert import Surgery
from lightning_lowmem.surgery.measure import measure_saved
from lightning_lowmem.surgery.options import Options
from lightning_lowmem.surgery.report import LowMemReport
from lightning_lowmem.surgery.training_memory import GIB

KIB, MIB = 1024.0, float(1 << 20)


@dataclass(frozen=True)
class Config:
    """A model's real dimensions (its public config), and how to build it at any depth."""

    name: str
    family: str  # transformers config class prefix ("Llama", "Mistral", "Qwen2", "Gemma2", "Phi3"), "vit", "bert"
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    tied: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def causal(self) -> bool:
        return self.family not in ("vit", "bert")


CONFIGS = {
    c.name: c
    for c in (
        Config("LLaMA-2-7B", "Llama", 4096, 11008, 32, 32, 32, 32000),
        Config("Llama-3-8B", "Llama", 4096, 14336, 32, 8, 32, 128256),
        Config("Llama-3.2-1B", "Llama", 2048, 8192, 32, 8, 16, 128256, tied=True),
        Config("Mistral-7B-v0.1", "Mistral", 4096, 14336, 32, 8, 32, 32000),
        Config("Qwen2.5-0.5B", "Qwen2", 896, 4864, 14, 2, 24, 151936, tied=True),
        Config("Qwen2.5-7B", "Qwen2", 3584, 18944, 28, 4, 28, 152064),
        # Gemma 2 2B: head_dim 256 (8 x 256 = 2048 != hidden), GeGLU (tanh GELU), logits soft-capped; its attention
        # soft-caps too, which only the eager implementation does: its bytes per token grow with the length
        Config("Gemma-2-2B", "Gemma2", 2304, 9216, 8, 4, 26, 256000, tied=True, extra={"head_dim": 256}),
        Config("Phi-3-mini", "Phi3", 3072, 8192, 32, 32, 32, 32064),
        Config("ViT-B/16 (224 px)", "vit", 768, 3072, 12, 12, 12, 0),
        Config("BERT-base", "bert", 768, 3072, 12, 12, 12, 30522),
    )
}
SMOKE = {"tiny LLaMA": Config("tiny LLaMA", "Llama", 64, 172, 4, 2, 4, 128)}  # for the test that the script runs
QUICK = ["Qwen2.5-0.5B", "LLaMA-2-7B", "ViT-B/16 (224 px)"]
QUICK_RECIPES = ["lora"]
# QLoRA builds through a checkpoint on disk (transformers quantizes on load): the causal LMs, which people QLoRA
QLORA_MODELS = [name for name, config in CONFIGS.items() if config.family not in ("vit", "bert")]

RECIPES = {  # name -> (description, LoRA config or None for full fine-tuning, quantized base?)
    "full": ("full fine-tuning, bf16", None, False),
    "lora": ("LoRA r=16 all linears, `lora_dropout` 0.05", {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05}, False),
    "qlora": ("QLoRA nf4, LoRA r=64 all linears, `lora_dropout` 0.1", {"r": 64, "lora_alpha": 16, "lora_dropout": 0.1}, True),
}  # fmt: skip
# LoRA targets per family: every linear layer of the blocks (not the head)
TARGETS = {
    "Phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "vit": ["qkv", "proj", "fc1", "fc2"],
    "bert": ["query", "key", "value", "dense"],
}
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Block patterns per family (find_blocks needs two same-class blocks; a 1-layer model has one)
BLOCKS = {"vit": ["*blocks.[0-9]"], "bert": ["*encoder.layer.[0-9]"]}
DECODER_BLOCKS = ["*layers.[0-9]"]

# The paper's variant: its two ops alone (approximate activation + memory-sharing norm); stock everything else
PAPER = {"activation": True, "norm": True, "gated": False, "linear": False, "dropout": False, "head": False,
         "attention": False}  # fmt: skip
VARIANTS = {"paper": PAPER, "ours": {}}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def hf_config(config: Config, layers: int) -> Any:
    import transformers

    kwargs = {
        "hidden_size": config.hidden, "intermediate_size": config.intermediate, "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads, "num_hidden_layers": layers, "vocab_size": config.vocab,
        "tie_word_embeddings": config.tied, "max_position_embeddings": 4096, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2, **config.extra,
    }  # fmt: skip
    if config.family == "bert":
        drop = ("num_key_value_heads", "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id")
        kwargs = {k: v for k, v in kwargs.items() if k not in drop}
        kwargs["max_position_embeddings"] = 512  # BERT's dropouts stay its own (0.1)
    if config.family == "Gemma2":
        kwargs["max_position_embeddings"] = 8192
    return getattr(transformers, f"{'Bert' if config.family == 'bert' else config.family}Config")(**kwargs)


def build(
    config: Config, layers: int, recipe: str, directory: str, base: nn.Module | None = None, attention: str = "sdpa"
) -> nn.Module:
    """The model at ``layers`` blocks, bf16 weights, with the recipe's adapters (random B, so LoRA changes the
    function as it does after a step); ``base``: the bf16 model already built, to adapt."""
    import peft
    import transformers

    _, lora, quantized = RECIPES[recipe]
    torch.manual_seed(0)
    if base is not None and not quantized:
        model = base
    elif config.family == "vit":
        import timm

        with default_dtype(torch.bfloat16):
            model = timm.create_model("vit_base_patch16_224", pretrained=False, depth=layers)
    elif quantized:
        with default_dtype(torch.bfloat16):
            transformers.AutoModelForCausalLM.from_config(hf_config(config, layers)).save_pretrained(directory)
        quantization = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True,
        )  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, quantization_config=quantization, device_map="cpu", dtype=torch.bfloat16,
            attn_implementation="eager" if config.family == "Gemma2" else attention,  # Gemma 2: no SDPA (soft-caps)
        )  # fmt: skip
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        bert = config.family == "bert"
        cls = transformers.BertForQuestionAnswering if bert else transformers.AutoModelForCausalLM.from_config
        with default_dtype(torch.bfloat16):
            model = cls(hf_config(config, layers))
    if lora is not None:
        targets = TARGETS.get(config.family, LLAMA_TARGETS)
        model = peft.get_peft_model(model, peft.LoraConfig(target_modules=targets, **lora))
        for name, param in model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(param, std=0.02)
    return model.train()


def example(config: Config, tokens: int, images: int = 2) -> tuple[Any, int]:
    """The example input and how many tokens (images for ViT) it holds."""
    generator = torch.Generator().manual_seed(0)
    if config.family == "vit":
        return torch.randn(images, 3, 224, 224, generator=generator), images
    ids = torch.randint(3, config.vocab, (1, tokens), generator=generator)
    if config.family == "bert":
        return {"input_ids": ids}, tokens
    return {"input_ids": ids, "labels": ids, "use_cache": False}, tokens


def bf16() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


@dataclass
class Depth:
    """Saved bytes that grow with the tokens (see :func:`split`) of one model at one depth, per variant."""

    stock: int = 0
    paper: int = 0
    ours: int = 0
    checkpointed: int = 0  # ours with every block checkpointed: forward + the largest block recomputed
    fixed: dict[str, int] = field(default_factory=dict)  # per variant: saved bytes that do not grow with the tokens
    copies: dict[str, int] = field(default_factory=dict)  # per variant: autocast's weight copies
    seconds: float = 0.0


def split(meter: SavedTensorMeter, model: nn.Module, counts: set[int]) -> tuple[int, int, int]:
    """A measurement's bytes in three: what grows with the input; a gradient computed in the forward (a
    storage shaped as a trained parameter with no dimension in ``counts``, the tokens or images: the head's
    weight gradient of the fused head, held until backward as stock holds ``.grad`` after it); and autocast's
    weight copies. (Not by shape alone: the 2-bit codes are a flat byte tensor.)"""
    shapes = {tuple(p.shape) for p in model.parameters() if p.requires_grad}
    grows = fixed = copies = 0
    for record in meter.records:
        if record.weight_copy:
            copies += record.nbytes
        elif record.shape in shapes and not counts & set(record.shape):
            fixed += record.nbytes
        else:
            grows += record.nbytes
    return grows, fixed, copies


def block_bytes(meter: SavedTensorMeter, name: str) -> int:
    """What block ``name`` saves itself (what its recomputation holds again), autocast's weight copies apart."""
    inside = lambda module: module == name or module.startswith(f"{name}.")
    return sum(r.nbytes for r in meter.records if inside(r.module) and not r.weight_copy)


def converted(model: nn.Module, x: Any, options: dict[str, Any], verify: bool) -> Surgery:
    with bf16():
        return run(LowMemReport(), model, Options(**options, verify=verify, measure=False), x)


def measure_depths(config: Config, recipes: list[str], layers: int, tokens: int, verify: bool) -> dict[str, Depth]:
    """Each recipe's :class:`Depth` at ``layers`` blocks; full fine-tuning and LoRA share one base model (full
    fine-tuning measured first; the LoRA adapters then wrap it)."""
    results: dict[str, Depth] = {}
    base = None
    for recipe in sorted(recipes, key=list(RECIPES).index):
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as directory:
            model = build(config, layers, recipe, directory, base)
        print(f"    {config.name}, {recipe}, {layers} layers: built in {time.perf_counter() - start:.1f} s", flush=True)
        base = model if recipe == "full" else None
        results[recipe] = measure_model(model, config, tokens, verify)
        results[recipe].seconds = time.perf_counter() - start
        del model
        gc.collect()
    return results


def measure_model(model: nn.Module, config: Config, tokens: int, verify: bool) -> Depth:
    """Stock, the paper's variant, ours and ours with every block checkpointed; ``model`` left as it was."""
    x, count = example(config, tokens)
    counts = {count, 197 * count} if config.family == "vit" else {tokens}
    depth = Depth()
    names = find_blocks(model, BLOCKS.get(config.family, DECODER_BLOCKS))
    with bf16():
        depth.stock, depth.fixed["stock"], depth.copies["stock"] = split(measure_saved(model, x), model, counts)
    for variant, options in VARIANTS.items():
        surgery = converted(model, x, options, verify)
        with bf16():
            meter = measure_saved(model, x)
            grows, depth.fixed[variant], depth.copies[variant] = split(meter, model, counts)
            setattr(depth, variant, grows)
            if variant == "ours":  # every block checkpointed, on the converted model
                own = max(block_bytes(meter, name) for name in names)
                wrapped = Surgery(model)
                for name in names:
                    checkpoint_block(wrapped, model.get_submodule(name))
                depth.checkpointed = split(measure_saved(model, x), model, counts)[0] + own
                wrapped.rollback()
        surgery.rollback()
    return depth


def full_depth(one: float, two: float, layers: int) -> float:
    """``rest + layers * per_layer`` from the 1- and 2-layer figures."""
    per_layer = two - one
    return one - per_layer + layers * per_layer


def human(nbytes: float) -> str:
    return f"{nbytes / MIB:.2f} MiB" if nbytes >= MIB else f"{nbytes / KIB:.0f} KiB"


def change(new: float, old: float) -> str:
    return f"{human(new)} ({100 * (new / old - 1):+.1f}%)"


def measure(config: Config, recipes: list[str], tokens: int, verify: bool, check: bool = False) -> list[list[str]]:
    """One row per recipe: per-token bytes at full depth of every variant, from the 1- and 2-layer models (and
    with ``check``, the 3-layer model measured against the extrapolation)."""
    recipes = [r for r in recipes if supports(config, r)]
    ones, twos = (measure_depths(config, recipes, n, tokens, verify) for n in (1, 2))
    threes = measure_depths(config, recipes, 3, tokens, verify) if check else {}
    _, per = example(config, tokens)
    variants = ("stock", "paper", "ours", "checkpointed")
    rows = []
    for recipe in recipes:
        one, two = ones[recipe], twos[recipe]
        at_depth = {v: full_depth(getattr(one, v), getattr(two, v), config.layers) / per for v in variants}
        slopes = ", ".join(f"{v} {human((getattr(two, v) - getattr(one, v)) / per)}" for v in variants)
        print(
            f"  {config.name}, {recipe}: per {'image' if config.family == 'vit' else 'token'}, 1 layer -> 2 layers: "
            + ", ".join(f"{v} {human(getattr(one, v) / per)} -> {human(getattr(two, v) / per)}" for v in variants)
            + f"; per layer: {slopes}; not growing with the tokens (2 layers, bytes): {two.fixed}, autocast's "
            f"weight copies {two.copies}; {one.seconds + two.seconds:.0f} s",
            flush=True,
        )
        for v in variants if recipe in threes else ():
            predicted, measured = full_depth(getattr(one, v), getattr(two, v), 3), getattr(threes[recipe], v)
            print(
                f"  3 layers, {v}: extrapolated {predicted} B, measured {measured} B ({measured / predicted - 1:+.2%})"
            )
        stock = at_depth["stock"]
        rows.append([
            config.name, RECIPES[recipe][0], human(stock), change(at_depth["paper"], stock),
            change(at_depth["ours"], stock), change(at_depth["checkpointed"], stock),
        ])  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)
    return rows


def supports(config: Config, recipe: str) -> bool:
    return recipe != "qlora" or config.causal


def lengths(names: list[str]) -> None:
    """Per-token bytes at 128, 256 and 512 tokens, 1 layer, LoRA: how much they depend on the length."""
    for name in names:
        config = CONFIGS[name]
        if not config.causal and config.family != "bert":
            continue
        cells = []
        for tokens in (128, 256, 512):
            depth = measure_depths(config, ["lora"], 1, tokens, verify=False)["lora"]
            cells.append(f"{tokens}: stock {human(depth.stock / tokens)}, ours {human(depth.ours / tokens)}")
        print(f"{name} (1 layer, LoRA) per token: " + "; ".join(cells), flush=True)


# -- the paper's max-length table (LLaMA-7B, QLoRA r=64 on all linears, batch 1, one 24 GB RTX 4090) -------------
PAPER_LENGTHS = {  # the paper's appendix table: apply_lowmem options (None: stock) -> its max length
    "SiLU, RMSNorm (stock QLoRA)": (None, 1354),
    "ReSiLU2, RMSNorm": ({**PAPER, "norm": False}, 1504),
    "SiLU, MS-RMSNorm": ({**PAPER, "activation": False}, 1654),
    "ReSiLU2, MS-RMSNorm (the paper's)": (PAPER, 1979),
    "lightning-lowmem (defaults)": ({}, None),
}
PAPER_BUDGET_GIB = 24.0


def qlora_as_the_paper(directory: str, layers: int, attention: str, dropout: float) -> nn.Module:
    """LLaMA-7B dims in QLoRA's own setting (its repository's ``qlora.py``, which the paper ran): nf4 with double
    quantization, bf16 compute, LoRA r=64 alpha 16 (``dropout``: 0.1 in its 7B scripts) on all linears, adapters, embedding and head in
    bf16 (norms fp32); ``attention`` "eager" as in the transformers of its time (no SDPA in LLaMA before 4.36)."""
    RECIPES["qlora"][1]["lora_dropout"] = dropout
    model = build(CONFIGS["LLaMA-2-7B"], layers, "qlora", directory, attention=attention)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in ("lora_A", "lora_B", "lm_head", "embed_tokens"):
            module.to(torch.bfloat16)
    return model


def extrapolate(one: TrainingMemory, two: TrainingMemory, layers: int) -> TrainingMemory:
    """Every term of a :class:`TrainingMemory` is linear in the depth: ``layers`` blocks from 1 and 2."""
    return TrainingMemory(**{
        f.name: type(getattr(one, f.name))(full_depth(getattr(one, f.name), getattr(two, f.name), layers))
        for f in fields(TrainingMemory)
    })  # fmt: skip


def paper_lengths(tokens: int, attention: str, dropout: float = 0.1) -> str:
    """The paper's max-length table predicted by :func:`lightning_lowmem.training_memory`, at full depth."""
    config = CONFIGS["LLaMA-2-7B"]
    memories: dict[str, list[TrainingMemory]] = {name: [] for name in PAPER_LENGTHS}
    for layers in (1, 2):
        with tempfile.TemporaryDirectory() as directory:
            model = qlora_as_the_paper(directory, layers, attention, dropout)
        x, _ = example(config, tokens)
        for name, (options, _) in PAPER_LENGTHS.items():
            with bf16():
                memory = training_memory(model, x, "paged_adamw_32bit", lowmem=options is not None, **(options or {}))
            memories[name].append(memory)
        del model
        gc.collect()
    budget = PAPER_BUDGET_GIB * GIB
    rows, stock_length = [], None
    for name, (_, paper) in PAPER_LENGTHS.items():
        memory = extrapolate(*memories[name], config.layers)
        length = memory.max_length(budget)
        stock_length = stock_length or length
        at_paper = f"{memory.bytes_at(paper) / GIB:.2f}" if paper else "-"
        rows.append([
            name, f"{paper} ({100 * (paper / 1354 - 1):+.0f}%)" if paper else "-",
            f"{length} ({100 * (length / stock_length - 1):+.0f}%)", f"{100 * (length / paper - 1):+.1f}%" if paper else "-",
            at_paper, f"{memory.linear / MIB:.3f} MiB + {memory.quadratic / KIB:.2f} KiB x T",
        ])  # fmt: skip
        print(f"  {name}: {memory.summary(length)}", flush=True)
    header = [
        f"LLaMA-7B, QLoRA r=64 all linears, `lora_dropout` {dropout:g}, batch 1, {attention} attention", "paper's max length (24 GB RTX 4090)",
        f"predicted max length ({PAPER_BUDGET_GIB:g} GiB)", "prediction vs paper", "predicted GiB at the paper's length",
        "activations per token (at length T)",
    ]  # fmt: skip
    table = markdown_table(header, rows)
    print(table)
    return table


PAPER_SECTION = (
    "## Real scale: the paper's max sequence length of LLaMA-7B under QLoRA, predicted\n\n"
    "The paper's appendix table (LLaMA-7B, QLoRA r=64 on all linears, batch 1, one 24 GB RTX 4090, measured by "
    "trying lengths) against `lightning_lowmem.training_memory` at full depth: weights (nf4 with double "
    "quantization; embedding and head bf16), gradients and paged AdamW 32-bit state (8 B) of the bf16 LoRA "
    "adapters, and the activations one training forward saves for backward, measured at 256 and 513 tokens on 1- "
    "and 2-layer models at LLaMA-7B's dims and extrapolated to 32 layers; QLoRA's own setting (its 7B scripts' "
    "`lora_dropout` 0.1 unless the table says otherwise; on CPU stock dropout keeps fp32 masks, 4 B per element where "
    "CUDA keeps 1, which overstates stock's and the paper variant's bytes against a GPU), "
    "with the eager attention of the transformers of the time (its fp32 softmax is the quadratic term) and with "
    "SDPA (today's default). The memory model "
    "counts no CUDA context, workspace, fragmentation or backward transients (the logits' gradient, one layer's "
    "attention-score gradient): it predicts an upper bound of the length.\n\n"
)


DOCS = Path(__file__).resolve().parents[1] / "docs"
HEADER = [
    "model (real dims, full depth)",
    "recipe",
    "stock",
    "paper's two ops (ReSiLU2/ReGELU2 + MS-norm)",
    "lightning-lowmem",
    "lightning-lowmem, every block checkpointed",
]


def quiet() -> None:
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 3-layer check, no RESULTS.md update")
    parser.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK)}, LoRA only; no RESULTS.md update")
    parser.add_argument("--models", nargs="*", choices=list(CONFIGS), help="these models only (no RESULTS.md update)")
    parser.add_argument("--recipes", nargs="*", choices=list(RECIPES), help="these recipes only (no RESULTS.md update)")
    parser.add_argument("--tokens", type=int, default=256, help="sequence length of the measurement (batch 1)")
    parser.add_argument("--lengths", action="store_true", help="per-token bytes at 128/256/512 tokens, then exit")
    parser.add_argument("--verify", action="store_true", help="also check every conversion's outputs (slower)")
    parser.add_argument("--paper", action="store_true", help="the paper's LLaMA-7B QLoRA max-length table, predicted")
    parser.add_argument("--paper-dropout", type=float, default=0.1, help="lora_dropout of --paper (QLoRA's 7B: 0.1)")
    parser.add_argument("--check", action="store_true", help="also measure 3 layers against the extrapolation")
    args = parser.parse_args()
    quiet()
    if args.smoke:
        CONFIGS.update(SMOKE)
        args.models, args.recipes, args.tokens, args.check = list(SMOKE), ["lora"], 16, True
    names = args.models or (QUICK if args.quick else list(CONFIGS))
    recipes = args.recipes or (QUICK_RECIPES if args.quick else list(RECIPES))
    if args.lengths:
        lengths(names)
        return
    if args.paper:
        tables = "\n\n".join(paper_lengths(args.tokens, a, args.paper_dropout) for a in ("eager", "sdpa"))
        command = "python benchmarks/real_scale.py --paper" + (
            f" --paper-dropout {args.paper_dropout:g}" if args.paper_dropout != 0.1 else ""
        )
        write_section("real_scale_paper", PAPER_SECTION + tables, command)
        return
    rows = []
    start = time.perf_counter()
    # each model in a process of its own: glibc keeps the freed heap of the last 8B model (23 GB RSS by Mistral)
    context = multiprocessing.get_context("spawn")
    for name in names:
        chosen = [r for r in recipes if r != "qlora" or args.recipes or args.smoke or name in QLORA_MODELS]
        if args.smoke:  # the smoke test runs in-process
            rows += measure(CONFIGS[name], chosen, args.tokens, args.verify, args.check)
            continue
        with ProcessPoolExecutor(1, mp_context=context, initializer=quiet) as pool:
            rows += pool.submit(measure, CONFIGS[name], chosen, args.tokens, args.verify, args.check).result()
    rows.sort(key=lambda row: [recipe[0] for recipe in RECIPES.values()].index(row[1]))
    table = markdown_table(HEADER, rows)
    print(table)
    print(f"{time.perf_counter() - start:.0f} s")
    if args.quick or args.models or args.recipes:
        return
    body = (
        "## Real scale: activation memory per token at full depth\n\n"
        "Saved-for-backward bytes of one training forward per token (per image for ViT-B/16: 197 tokens), at the "
        "real hidden, intermediate, heads and vocabulary of each model's public config (random init), bf16 weights "
        f"and bf16 autocast, batch 1 x {args.tokens} tokens (ViT: 2 images at 224 px), autocast's weight copies "
        "apart (they do not grow with the tokens). Full depth from 1- and 2-layer models: `rest + depth x "
        "(2-layer - 1-layer)`. Causal LMs are called with `labels` (the loss inside the forward). Paper's two ops: "
        f"`apply_lowmem({', '.join(f'{key}={value}' for key, value in PAPER.items())})`; every "
        "block checkpointed: the converted model with each decoder block under activation checkpointing (what the "
        "smallest `budget_mib` gives), its forward plus one block recomputed in backward. Gemma 2's attention is "
        "eager (its soft-capping has no SDPA kernel), so its per-token bytes grow with the length; BERT keeps its "
        "0.1 dropouts. LoRA adapters fp32 (peft's default on a bf16 base); QLoRA: transformers' "
        "`BitsAndBytesConfig` nf4 with double quantization and bf16 compute, `prepare_model_for_kbit_training`. "
        "Stock dropout masks are counted as a GPU keeps them (a bool mask: CPU's `F.dropout` keeps one in the "
        "input's dtype, 4 B for an fp32 adapter's input).\n\n" + table
    )
    write_section("real_scale", body, "python benchmarks/real_scale.py")
    headline = (
        "### Per token, at full scale\n\nActivation memory one training step keeps per token (per image for ViT) "
        f"at the real dims and depth of each model, bf16 weights and autocast, {args.tokens} tokens, labels "
        "passed: stock, the paper's two ops alone, lightning-lowmem's defaults, and with every block checkpointed "
        "(the floor of `budget_mib`). From 1- and 2-layer models at the real dims (`benchmarks/real_scale.py`; "
        "activation memory is linear in depth, checked against 3 layers). Stock dropout masks counted as a GPU keeps "
        "them (1 B per element).\n\n" + table
    )
    write_section("real_scale", headline, "python benchmarks/real_scale.py", DOCS / "index.md")


if __name__ == "__main__":
    main()
