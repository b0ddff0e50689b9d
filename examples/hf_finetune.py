"""Fine-tune a LLaMA-architecture causal LM with peft LoRA through Hugging Face's ``Trainer`` or TRL's
``SFTTrainer``, with lightning-lowmem's one line: ``callbacks=[LowMemCallback()]``.

Data: instructions made from the Python standard library's documented functions (write the docstring of this
signature), prompts not trained on, a byte-level BPE tokenizer trained on the spot (nothing is downloaded). The
model is a random-init ``LlamaForCausalLM`` with LLaMA-2's proportions at a small size.

    python examples/hf_finetune.py --trainer sft --steps 20
    python examples/hf_finetune.py --trainer trainer --stock      # the baseline, without the callback
    torchrun --nproc-per-node 2 examples/hf_finetune.py --trainer sft
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import transformers
from peft import LoraConfig, get_peft_model

try:  # run as a script (examples/ is on sys.path) or imported as examples.hf_finetune
    from stdlib_data import SPECIAL, docstring_samples, make_tokenizer
except ImportError:
    from examples.stdlib_data import SPECIAL, docstring_samples, make_tokenizer

from lightning_lowmem.hf import LowMemCallback

LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", choices=["trainer", "sft"], default="sft")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lora-dropout", type=float, default=0.05)
    parser.add_argument("--stock", action="store_true", help="train without lightning-lowmem (the baseline)")
    parser.add_argument(
        "--checkpointing", action="store_true",
        help="HF's gradient checkpointing (SFTConfig's default): the converted ops then save in each block's "
        "recompute, which the report's one-forward figure does not see",
    )  # fmt: skip
    return parser.parse_args(argv)


def tokenizer_on_the_spot(directory: Path) -> transformers.PreTrainedTokenizerFast:
    make_tokenizer(directory, vocab=2048)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), pad_token=SPECIAL["eos_token"], **SPECIAL
    )


def model_of(args: argparse.Namespace, vocab: int) -> torch.nn.Module:
    """LLaMA-2-7B's proportions (intermediate 11,008 / hidden 4,096, head dim 128 where it fits) at a small size."""
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=round(args.hidden * 11008 / 4096),
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64), max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=args.lora_dropout, target_modules=LLAMA_LINEARS)
    return get_peft_model(transformers.LlamaForCausalLM(config), lora)


def rows(tokenizer, samples: list[dict[str, str]]) -> list[dict[str, list[int]]]:
    """Token ids and labels of each sample, the prompt's labels -100 (completion only), for ``Trainer``."""
    out = []
    for sample in samples:
        prompt = tokenizer(f"{sample['instruction']}\n{sample['input']}\n")["input_ids"]
        answer = tokenizer(sample["output"] + SPECIAL["eos_token"])["input_ids"]
        ids = (prompt + answer)[:256]
        out.append({"input_ids": ids, "labels": ([-100] * len(prompt) + answer)[:256]})
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    callbacks = [] if args.stock else [LowMemCallback()]
    samples = docstring_samples(args.samples)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = tokenizer_on_the_spot(Path(scratch))
        model = model_of(args, len(tokenizer))
        common = {
            "output_dir": str(Path(scratch) / "out"), "per_device_train_batch_size": args.batch_size,
            "max_steps": args.steps, "gradient_accumulation_steps": 2, "learning_rate": 2e-3, "report_to": [],
            "logging_steps": max(1, args.steps // 5), "save_strategy": "no", "seed": 0, "disable_tqdm": True,
            "use_cpu": not torch.cuda.is_available(), "gradient_checkpointing": args.checkpointing,
        }  # fmt: skip
        if args.trainer == "sft":
            import datasets
            import trl

            data = datasets.Dataset.from_list(
                [{"prompt": f"{s['instruction']}\n{s['input']}\n", "completion": s["output"]} for s in samples]
            )
            config = trl.SFTConfig(**common, bf16=torch.cuda.is_available(), max_length=256)
            trainer = trl.SFTTrainer(
                model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=callbacks
            )
        else:
            collator = transformers.DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
            trainer = transformers.Trainer(
                model=model, args=transformers.TrainingArguments(**common), train_dataset=rows(tokenizer, samples),
                data_collator=collator, callbacks=callbacks,
            )  # fmt: skip
        trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    result = {"losses": losses}
    if callbacks and trainer.is_world_process_zero():
        report = callbacks[0].report
        result["saved_mib"] = (report.saved_bytes_before / 2**20, report.saved_bytes_after / 2**20)
        print(
            f"activations saved for backward by one forward: {result['saved_mib'][0]:.2f} MiB stock -> "
            f"{result['saved_mib'][1]:.2f} MiB with lightning-lowmem ({-report.reduction:+.1%})"
        )
    return result


if __name__ == "__main__":
    main()
