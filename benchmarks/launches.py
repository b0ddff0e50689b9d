"""What a training step asks of the dispatcher: operator calls and seed draws per step, stock vs converted, by op.

On a GPU a fine-tuning step of these sizes is bound by the host: each operator call costs the CPU 5-40 us of
dispatch and launch whatever the kernel does (``../shared/gpu/h100-2026-11-27``: converted steps 1.3-1.7x stock's
with less GPU time). So the count of calls is the CPU's proxy for a GPU's step time: the profiler's ``aten::`` and
``lowmem::`` operator calls that no other operator call encloses (what Python and the autograd engine dispatch), the
innermost calls that compute (a kernel launch each on a GPU, whoever dispatches them), per training step (forward,
loss, backward), and among the first the seed draws (``aten::randint``, ``aten::random_``: a launch each on a GPU). Counts, not times: no
quiet machine needed. Models: tiny LoRA BERT and LoRA LLaMA (peft, r=8 on every linear, ``lora_dropout`` 0.05) and a
ViT (full fine-tuning), fp32, on the CPU kernels (their autograd in C++, as the CUDA extension's); and again as a
GPU without the CUDA extension runs them: the Triton kernels, run by Triton's interpreter in a second process (each
launch a kernel call), and the Python autograd functions.

    python benchmarks/launches.py [--smoke] [--top N]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
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

NAMESPACES = ("aten::", "lowmem::", "lowmem_triton::", "triton::")
GPU_SIDE = {"LIGHTNING_LOWMEM_BACKEND": "triton", "TRITON_INTERPRET": "1"}
"""The environment of the Triton fallback on a CPU: Triton's kernels, interpreted, as the ops call them on a GPU without
the CUDA extension."""
SEED_DRAWS = ("aten::randint", "aten::random_")
NO_KERNEL = frozenset(
    f"aten::{name}"
    for group in (
        ("view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "t", "transpose", "permute", "select"),
        ("slice", "narrow", "expand", "expand_as", "as_strided", "as_strided_", "unsqueeze", "squeeze", "detach"),
        ("alias", "unbind", "split", "chunk", "empty", "empty_like", "empty_strided", "new_empty", "resize_", "to"),
        ("contiguous", "lift_fresh", "result_type", "promote_types", "resolve_conj", "resolve_neg", "dropout"),
        ("flatten",),
    )
    for name in group
)
"""Operator calls that launch nothing where no other call runs inside them: views, allocations, a conversion or a
dropout that returns its input."""
GPU_FUSED = frozenset({"aten::bernoulli_"})
"""Calls a GPU makes inside another's kernel: stock dropout's mask draw (the CPU's ``native_dropout`` draws with
``bernoulli_`` then multiplies; a GPU's is one fused kernel)."""
NOT_KERNELS = NO_KERNEL | GPU_FUSED


def _recording_triton_launches() -> None:
    """Each launch of an interpreted Triton kernel a profiler event ``triton::<kernel>``: a kernel call."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recorded(self, *args, **kwargs):
        with torch.profiler.record_function(f"triton::{self.fn.__name__}"):
            return run(self, *args, **kwargs)

    InterpretedFunction.run = recorded


def _inside_a_triton_kernel(event) -> bool:
    """Whether ``event`` is the interpreter's own work inside a Triton launch (copies to and from its arrays)."""
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith("triton::"):
        parent = parent.cpu_parent
    return parent is not None


def _operator_parent(event):
    """The nearest enclosing ``aten::``/``lowmem::`` call of a profiler event (None at top level)."""
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith(NAMESPACES):
        parent = parent.cpu_parent
    return parent


def profiled_calls(step: Callable[[], object]) -> tuple[Counter[str], Counter[str]]:
    """The operator calls of ``step`` (names in :data:`NAMESPACES`): those that no other such call encloses (what
    the host dispatches), and the kernel calls: each call that computes (not in :data:`NO_KERNEL` or
    :data:`GPU_FUSED`) and runs no other that does (a kernel launch each on a GPU, whoever dispatches it)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.events() if e.name.startswith(NAMESPACES) and not _inside_a_triton_kernel(e)]
    parents = {id(e): _operator_parent(e) for e in events}
    computes_inside: set[int] = set()  # calls with a computing call inside them
    for event in events:
        if event.name not in NOT_KERNELS:
            parent = parents[id(event)]
            while parent is not None and id(parent) not in computes_inside:
                computes_inside.add(id(parent))
                parent = parents[id(parent)]
    top_level, kernel_calls = Counter(), Counter()
    for event in events:
        if parents[id(event)] is None:
            top_level[event.name] += 1
        if event.name not in NOT_KERNELS and id(event) not in computes_inside:
            kernel_calls[event.name] += 1
    return top_level, kernel_calls


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


def count(build: Callable[[], tuple[nn.Module, object]]) -> list[tuple[Counter[str], Counter[str]]]:
    """:func:`profiled_calls` of one training step (the second: the first makes lazy state), stock then converted."""
    torch.manual_seed(0)
    stock, example = build()
    converted = copy.deepcopy(stock)
    apply_lowmem(converted, example_input=example, verify=False)
    counted = []
    for model in (stock, converted):
        step = training_step(model.train(), example)
        step()
        counted.append(profiled_calls(step))
    return counted


def by_op(stock: Counter[str], converted: Counter[str], top: int) -> str:
    """The ops whose count changed most, as a table."""
    changed = sorted(stock.keys() | converted.keys(), key=lambda n: (-abs(converted[n] - stock[n]), n))
    rows = [[f"`{n}`", stock[n], converted[n], f"{converted[n] - stock[n]:+d}"] for n in changed[:top]]
    return markdown_table(["op", "stock", "converted", "change"], rows)


def gpu_side(smoke: bool) -> dict[str, list[dict[str, int]]]:
    """:func:`count` per model with the Triton fallback (:data:`GPU_SIDE`), in a fresh process (Triton reads the
    variables when it first loads)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "gpu_side.json"
        command = [sys.executable, __file__, "--gpu-side-json", str(out)] + (["--smoke"] if smoke else [])
        subprocess.run(command, check=True, env={**os.environ, **GPU_SIDE}, timeout=1800)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="16 tokens, no RESULTS.md update")
    parser.add_argument("--top", type=int, default=12, help="ops listed per model, by the change in their count")
    parser.add_argument("--gpu-side-json", help=argparse.SUPPRESS)  # the second process: counts to this file
    args = parser.parse_args()
    if args.gpu_side_json:
        _recording_triton_launches()
        counted = {name: [c for pair in count(build) for c in pair] for name, build in models(args.smoke).items()}
        Path(args.gpu_side_json).write_text(json.dumps(counted))
        return
    gpu = gpu_side(args.smoke)
    rows, details = [], []
    for name, build in models(args.smoke).items():
        (stock, stock_kernels), (converted, converted_kernels) = count(build)
        _, _, gpu_converted, gpu_kernels = map(Counter, gpu[name])  # stock's, then converted's: calls, kernel calls
        totals = [
            sum(c.values()) for c in (stock, converted, gpu_converted, stock_kernels, converted_kernels, gpu_kernels)
        ]
        draws = [sum(c[d] for d in SEED_DRAWS) for c in (stock, converted, gpu_converted)]
        calls = [f"{totals[0]}", *(f"{t} ({t / totals[0]:.2f}x)" for t in totals[1:3])]
        kernel_calls = [f"{totals[3]}", *(f"{t} ({t / totals[3]:.2f}x)" for t in totals[4:6])]
        rows.append([name, *calls, *kernel_calls, "/".join(map(str, draws))])
        details.append(
            f"{name}, calls:\n\n{by_op(stock, converted, args.top)}\n\n"
            f"{name}, kernel calls:\n\n{by_op(stock_kernels, converted_kernels, args.top)}\n\n"
            f"{name}, kernel calls, Triton fallback:\n\n{by_op(stock_kernels, gpu_kernels, args.top)}"
        )
        print(" | ".join(map(str, rows[-1])), flush=True)
    header = ["model (random init, fp32)", "stock calls", "converted", "converted, Triton fallback",
              "stock kernel calls", "converted", "converted, Triton fallback",
              "seed draws (stock / converted / Triton fallback)"]  # fmt: skip
    body = (
        "## Operator calls per training step (the host's work on a GPU)\n\n"
        "Per training step (forward, loss, backward), stock and converted: on the CPU kernels (backend "
        f"`{kernels.backend('cpu')}`, their autograd in C++ as the CUDA extension's, a GPU's default), and as the "
        "Triton fallback (`LIGHTNING_LOWMEM_BACKEND=triton TRITON_INTERPRET=1`: the Triton kernels interpreted and the "
        "Python autograd functions, as a GPU without the CUDA extension runs them). *Calls*: the profiler's `aten::`, "
        "`lowmem::` and `lowmem_triton::` calls that no other such call encloses (what Python and the autograd engine "
        "dispatch: host time on a GPU). *Kernel calls*: the innermost calls that compute (no other computing call "
        "inside; no view, allocation or no-op conversion; stock dropout's `bernoulli_` left out, which a GPU's fused "
        "dropout draws in its one kernel) and every Triton launch: a launch each on a GPU. The CUDA extension launches "
        "as the CPU kernels do but for two ops (ARCHITECTURE.md, \"Launches where the two differ\"): a trainable norm's "
        "backward takes 3 (the CPU 1: ViT +10 here) and a k-bit activation's forward 2 (ViT, BERT +2). Seed draws are "
        "`aten::randint` and `aten::random_`. At fine-tuning sizes a GPU step is bound by the host, so fewer of both is "
        "the CPU's proxy for a step as fast as stock's.\n\n" + markdown_table(header, rows) + "\n\n" + "\n\n".join(details)
    )  # fmt: skip
    print(body)
    if not args.smoke:
        write_section("launches", body, "python benchmarks/launches.py")


if __name__ == "__main__":
    main()
