"""The Python standard library as data (it ships with every Python: nothing is downloaded): its source as text,
a byte-level BPE tokenizer trained on it, and instruction samples from its documented functions."""

from __future__ import annotations

import ast
import json
import sysconfig
from pathlib import Path


def stdlib_files() -> list[Path]:
    """The standard library's top-level modules, in sorted order."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def stdlib_text(max_bytes: int) -> bytes:
    """The first ``max_bytes`` of :func:`stdlib_files`."""
    chunks, total = [], 0
    for path in stdlib_files():
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\n".join(chunks)[:max_bytes]


SPECIAL = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}


def make_tokenizer(directory: Path, vocab: int, max_bytes: int = 400_000) -> int:
    """A byte-level BPE of ``vocab`` tokens trained on the standard library, written as LitGPT reads one
    (``tokenizer.json``, ``tokenizer_config.json``); returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(SPECIAL.values()), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([stdlib_text(max_bytes).decode("utf-8", "replace")], trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({**SPECIAL, "add_bos_token": True, "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    return tokenizer.get_vocab_size()


def docstring_samples(limit: int) -> list[dict[str, str]]:
    """Up to ``limit`` Alpaca samples from the standard library's documented functions, in file order."""
    samples = []
    for path in stdlib_files():
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and (doc := ast.get_docstring(node)):
                signature = f"def {node.name}({ast.unparse(node.args)})"
                samples.append({"instruction": "Write the docstring of this Python function.", "input": signature,
                                "output": doc.split("\n\n")[0]})  # fmt: skip
                if len(samples) == limit:
                    return samples
    return samples
