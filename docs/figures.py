"""Draw the documentation's picture from a measurement: what one transformer block saves for backward.

A LLaMA-shaped decoder (Hugging Face ``LlamaForCausalLM``, random init, fp32, full fine-tuning; hidden 256,
intermediate 688, 4 heads, 2 x 128 tokens) is measured with the project's own meter
(:class:`lightning_lowmem.memory.SavedTensorMeter`) before and after :func:`lightning_lowmem.apply_lowmem`, and the
bytes first saved inside its first block are drawn as bars, one pair per sub-layer (each with the norm before it),
into ``docs/img/block.svg`` (plain SVG, written with string formatting: nothing to install). Every bar carries its
byte count (``data-bytes``), which ``tests/test_docs.py`` compares with a fresh measurement::

    python docs/figures.py            # measure and rewrite docs/img/block.svg (about 10 s on a CPU)
    python docs/figures.py --check    # measure; exit 1 if docs/img/block.svg shows other numbers
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

SVG = Path(__file__).resolve().parent / "img" / "block.svg"
ROOT = Path(__file__).resolve().parents[1]
BLOCK = "model.layers.0"
PARTS = {  # sub-layer -> module-name prefixes inside the block (the norm before it included)
    "attention (input norm, q/k/v/o, SDPA)": ("input_layernorm", "self_attn"),
    "MLP (post-attention norm, gate/up/down, SiLU)": ("post_attention_layernorm", "mlp"),
}
SHAPE = {"hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4, "num_key_value_heads": 4}
BATCH, TOKENS = 2, 128


def _part(module: str) -> str | None:
    if module != BLOCK and not module.startswith(BLOCK + "."):
        return None
    inner = module[len(BLOCK) + 1 :]
    for part, prefixes in PARTS.items():
        if inner.startswith(prefixes):
            return part
    return "the block's own code (residual adds, RoPE)"


def _saved(model, batch) -> dict[str, int]:
    """Bytes first saved for backward inside the block, by sub-layer, in one training forward."""
    from lightning_lowmem.memory import SavedTensorMeter

    model.train()
    with SavedTensorMeter(model) as meter:
        loss = model(**batch).loss
    totals = {part: 0 for part in PARTS}
    for record in meter.records:
        part = _part(record.module)
        if part is not None:
            totals[part] = totals.get(part, 0) + record.nbytes
    del loss  # the graph goes with it: nothing to run backward for
    return totals


def measure() -> dict[str, tuple[int, int]]:
    """``{sub-layer: (stock bytes, converted bytes)}`` for the first block, deterministic (sizes only)."""
    sys.path.insert(0, str(ROOT))
    import torch

    import lightning_lowmem
    from benchmarks import zoo

    torch.manual_seed(0)
    stock = zoo.llama(**SHAPE)
    ids = torch.randint(3, zoo.VOCAB, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    converted = copy.deepcopy(stock)
    lightning_lowmem.apply_lowmem(converted, example_input=batch)
    before, after = _saved(stock, batch), _saved(converted, batch)
    parts = [p for p in before if before[p] or after.get(p)]
    return {part: (before[part], after.get(part, 0)) for part in parts}


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:,.0f} KiB"


def draw(bars: dict[str, tuple[int, int]]) -> str:
    """The SVG: a pair of horizontal bars per sub-layer and for the whole block, each labelled in KiB."""
    rows = {**bars, "whole block": (sum(s for s, _ in bars.values()), sum(c for _, c in bars.values()))}
    left, width, bar, gap = 330, 300, 18, 4
    top = 56
    height = top + len(rows) * (2 * bar + gap + 22) + 40
    scale = width / max(max(pair) for pair in rows.values())
    out = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="760" height="{height}" viewBox="0 0 760 {height}" '
            'font-family="Helvetica, Arial, sans-serif" font-size="13" role="img">'
        ),
        "<title>What one LLaMA-shaped block saves for backward, stock vs lightning-lowmem</title>",
        '<rect x="0" y="0" width="760" height="100%" fill="white"/>',
        (
            '<text x="10" y="22" font-size="15" font-weight="bold">Saved for backward by one block, one training '
            "forward (fp32, full fine-tuning)</text>"
        ),
        (
            f'<text x="10" y="42" fill="#555">LlamaForCausalLM, hidden {SHAPE["hidden_size"]}, intermediate '
            f"{SHAPE['intermediate_size']}, {BATCH} x {TOKENS} tokens; measured by SavedTensorMeter "
            "(docs/figures.py)</text>"
        ),
    ]
    y = top
    for name, (before, after) in rows.items():
        change = f" ({(after - before) / before:+.0%})" if before else ""
        weight = ' font-weight="bold"' if name == "whole block" else ""
        out.append(f'<text x="10" y="{y + bar + 4}"{weight}>{name}</text>')
        for i, (label, value, color) in enumerate(
            (("stock", before, "#9e9e9e"), ("lightning-lowmem", after, "#3f51b5"))
        ):
            yy = y + i * (bar + gap)
            w = max(1, round(value * scale))
            kind = "stock" if i == 0 else "converted"
            out.append(
                f'<rect class="bar" x="{left}" y="{yy}" width="{w}" height="{bar}" fill="{color}" '
                f'data-part="{name}" data-kind="{kind}" data-bytes="{value}"/>'
            )
            text = f"{label}: {_kib(value)}" + (change if i == 1 else "")
            out.append(f'<text x="{left + w + 6}" y="{yy + bar - 4}">{text}</text>')
        y += 2 * bar + gap + 22
    out.append("</svg>")
    return "\n".join(out) + "\n"


def read(svg: str) -> dict[tuple[str, str], int]:
    """The bars' numbers in an SVG :func:`draw` wrote: ``{(part, "stock" | "converted"): bytes}``."""
    pattern = r'data-part="([^"]+)" data-kind="(stock|converted)" data-bytes="(\d+)"'
    return {(part, kind): int(value) for part, kind, value in re.findall(pattern, svg)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/img/block.svg, write nothing")
    args = parser.parse_args()
    svg = draw(measure())
    if args.check:
        same = SVG.exists() and read(SVG.read_text()) == read(svg)
        print("docs/img/block.svg is up to date" if same else "docs/img/block.svg differs: run python docs/figures.py")
        return 0 if same else 1
    SVG.parent.mkdir(parents=True, exist_ok=True)
    SVG.write_text(svg)
    print(f"wrote {SVG.relative_to(ROOT)}: {read(svg)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
