"""A tiny LitGPT checkpoint and instruction data, made on the spot (nothing is downloaded), for ``litgpt finetune_*``
and ``python -m lightning_lowmem.litgpt finetune_*``:

- the checkpoint: a random-init GPT of a real architecture's config (``--model``, any ``litgpt.Config`` name) at a
  small size, with a byte-level BPE tokenizer trained on the Python standard library's source;
- the data: Alpaca-style JSON, one sample per documented function of the standard library (instruction: write the
  docstring of this signature; output: the docstring).

    python examples/litgpt_checkpoint.py out/tiny-llama --data out/docstrings.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import litgpt
import torch
from litgpt.utils import save_config

try:  # run as a script (examples/ is on sys.path) or imported as examples.litgpt_checkpoint
    from stdlib_data import docstring_samples, make_tokenizer
except ImportError:
    from examples.stdlib_data import docstring_samples, make_tokenizer


def make_checkpoint(
    directory: Path, model: str = "Llama-2-7b-hf", n_layer: int = 4, n_embd: int = 64, n_head: int = 4,
    vocab: int = 1024, padded_vocab: int = 4096, seed: int = 0,
) -> litgpt.Config:  # fmt: skip
    """``directory`` as a LitGPT checkpoint: ``model``'s architecture at ``n_layer`` x ``n_embd`` (its MLP ratio
    kept), random weights, the tokenizer of :func:`make_tokenizer` (``padded_vocab`` rows in the embedding and
    head, as LitGPT pads real vocabularies)."""
    directory.mkdir(parents=True, exist_ok=True)
    real = litgpt.Config.from_name(model)
    config = litgpt.Config.from_name(
        model, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_query_groups=n_head, block_size=512,
        intermediate_size=round(real.intermediate_size / real.n_embd * n_embd),
        vocab_size=make_tokenizer(directory, vocab), padded_vocab_size=padded_vocab,
    )  # fmt: skip
    torch.manual_seed(seed)
    torch.save(litgpt.GPT(config).state_dict(), directory / "lit_model.pth")
    save_config(config, directory)
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--data", type=Path, help="also write this many samples' JSON here", default=None)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--model", default="Llama-2-7b-hf")
    args = parser.parse_args(argv)
    config = make_checkpoint(args.checkpoint, args.model)
    print(f"{args.checkpoint}: {config.name} at {config.n_layer} x {config.n_embd}, vocabulary {config.vocab_size}")
    if args.data is not None:
        samples = docstring_samples(args.samples)
        args.data.write_text(json.dumps(samples, indent=1))
        print(f"{args.data}: {len(samples)} samples")


if __name__ == "__main__":
    main()
