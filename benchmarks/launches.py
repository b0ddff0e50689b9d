"""What a training step asks of the dispatcher: operator calls and seed draws per step, stock vs converted, by op.

On a GPU a fine-tuning step of these sizes is bound by the host: each operator call costs the CPU 5-40 us of
dispatch and launch whatever the kernel does (``../shared/gpu/h100-2026-11-27``: converted steps 1.3-1.7x stock's
with less GPU time). So the count of calls is the CPU's proxy for a GPU's step time: the profiler's ``aten::`` and
``lowmem::`` operator calls that no other operator call encloses (what Python and the autograd engine dispatch; an
operator's own inner calls are its business, as ATen's composites'), per training step (forward, loss, backward),
and among them the seed draws (``aten::randint``, ``aten::random_``: a launch each on a GPU). Counts, not times: no
quiet machine needed. Models: tiny LoRA BERT and LoRA LLaMA (peft, r=8 on every linear, ``lora_dropout`` 0.05) and a
ViT (full fine-tuning), fp32, on the CPU kernels.

    python benchmarks/launches.py [--smoke] [--top N]
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import zoo
from benchmarks.common import markdown_table, write_section
from lightning_lowmem import apply_lowmem, kernels
from lightning_lowmem.surgery.example import call, tensors_in

NAMESPACES = ("aten::", "lowmem::")
SEED_DRAWS = ("aten::randint", "aten::random_")


def top_level_calls(step: Callable[[], object]) -> Counter[str]:
    """The operator calls of ``step`` (names in :data:`NAMESPACES`) that no other such call encloses."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts: Counter[str] = Counter()
    for event in prof.events():
        if not event.name.startswith(NAMESPACES):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(NAMESPACES):
            parent = parent.cpu_parent
        if parent is None:
            counts[event.name] += 1
    return counts


def training_step(model: nn.Module, example: object) -> Callable[[], None]:
    """Forward (the loss for a model given labels, else a sum of the output), backward; gradients dropped after."""

    def step() -> None:
        tensors_in(call(model, example))[0].sum().backward()
        model.zero_grad(set_to_none=True)

    return step


def models(smoke: bool) -> dict[str, Callable[[], tuple[nn.Module, object]]]:
    ids = torch.randint(0, zoo.VOCAB, (2, 16 if smoke else 64), generator=torch.Generator().manual_seed(0))
    lora = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.05}
    return {
        "LoRA BERT (2 layers, d=64), dropout 0.05": lambda: (
            zoo.lora(zoo.bert(hidden_dropout_prob=0.1), ["query", "key", "value", "dense"], **lora),
            {"input_ids": ids},
        ),
        "LoRA LLaMA (2 layers, d=64), dropout 0.05": lambda: (
            zoo.lora(zoo.llama(), zoo.LLAMA_LINEARS, **lora),
            {"input_ids": ids, "labels": ids},
        ),
        "ViT (2 blocks, d=192), full fine-tuning": lambda: (zoo.vit(), zoo.images()),
    }


def count(build: Callable[[], tuple[nn.Module, object]]) -> tuple[Counter[str], Counter[str]]:
    """Top-level calls of one training step (the second: the first makes lazy state), stock then converted."""
    torch.manual_seed(0)
    stock, example = build()
    converted = copy.deepcopy(stock)
    apply_lowmem(converted, example_input=example, verify=False)
    counted = []
    for model in (stock, converted):
        step = training_step(model.train(), example)
        step()
        counted.append(top_level_calls(step))
    return counted[0], counted[1]


def by_op(stock: Counter[str], converted: Counter[str], top: int) -> str:
    """The ops whose count changed most, as a table."""
    changed = sorted(stock.keys() | converted.keys(), key=lambda n: (-abs(converted[n] - stock[n]), n))
    rows = [[f"`{n}`", stock[n], converted[n], f"{converted[n] - stock[n]:+d}"] for n in changed[:top]]
    return markdown_table(["op", "stock", "converted", "change"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="16 tokens, no RESULTS.md update")
    parser.add_argument("--top", type=int, default=12, help="ops listed per model, by the change in their count")
    args = parser.parse_args()
    rows, details = [], []
    for name, build in models(args.smoke).items():
        stock, converted = count(build)
        total_stock, total_converted = sum(stock.values()), sum(converted.values())
        draws = [sum(c[d] for d in SEED_DRAWS) for c in (stock, converted)]
        rows.append([name, total_stock, total_converted, f"{total_converted / total_stock:.2f}x", *draws])
        details.append(f"{name}:\n\n{by_op(stock, converted, args.top)}")
        print(" | ".join(map(str, rows[-1])), flush=True)
    header = ["model (random init, fp32)", "stock calls", "converted calls", "converted / stock",
              "stock seed draws", "converted seed draws"]  # fmt: skip
    body = (
        "## Operator calls per training step (the host's work on a GPU)\n\n"
        "The profiler's `aten::` and `lowmem::` calls that no other such call encloses, per training step (forward, "
        "loss, backward), stock and converted, on the CPU kernels (backend "
        f"`{kernels.backend('cpu')}`); seed draws are `aten::randint` and `aten::random_`. On a GPU each call is "
        "host time (dispatch and launch), which decides the step time at fine-tuning sizes.\n\n"
        + markdown_table(header, rows) + "\n\n" + "\n\n".join(details)
    )  # fmt: skip
    print(body)
    if not args.smoke:
        write_section("launches", body, "python benchmarks/launches.py")


if __name__ == "__main__":
    main()
