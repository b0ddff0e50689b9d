"""The fused linear + cross-entropy against stock ``F.linear`` + ``F.cross_entropy`` and, where it is installed
(``pip install -e ".[peers]"``), Apple's Cut Cross-Entropy (``impl="torch_compile"``, its CPU path): time, saved
bytes, peak RSS, and the precision of a trained head's weight gradient.

- Time: head and loss, forward and backward, interleaved rounds in one process (ratio to stock), at the
  shapes issue 38 and 46 name: 2048 tokens x vocabulary 32,000 and 64k x hidden 512, LLaMA-2's head (1024 tokens x
  32,000 x 4096) and a 128k vocabulary (1024 x 131,072 x 1024), fp32 and bf16, the head frozen (LoRA, QLoRA) and
  trained (full fine-tuning).
- Precision: a trained bf16 head's weight gradient against fp64, relative to stock's error, as the number of chunks
  grows, accumulated over the chunks in fp32 (the default) and in bf16 (``accum_dtype=None``).
- Memory: saved-for-backward bytes per token (the slope between two token counts; a trained head's weight
  gradient, weight-sized, held from the forward, is not per token), and the process's peak RSS over one
  training step of a Qwen2-vocabulary (151,936) causal LM with LoRA, stock and fused, each in a fresh process.

    python benchmarks/cross_entropy.py [--smoke]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import interleaved_times, markdown_table, paired_ratio, warn_if_busy, write_section
from lightning_lowmem import kernels
from lightning_lowmem.functional import linear_cross_entropy
from lightning_lowmem.memory import SavedTensorMeter

SHAPES = ((2048, 32000, 512), (2048, 65536, 512), (1024, 32000, 4096), (1024, 131072, 1024))


def cut_cross_entropy():
    """Cut Cross-Entropy's ``linear_cross_entropy`` on its torch.compile path (the one that runs on CPU), or None."""
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
    except ImportError:
        return None
    return lambda hidden, weight, target: cce(hidden, weight, target, impl="torch_compile")


def stock(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), target)


def operands(rows: int, vocab: int, features: int, dtype: torch.dtype, trained: bool):
    hidden = torch.randn(rows, features).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, features) / features**0.5).to(dtype).requires_grad_(trained)
    return hidden, weight, torch.randint(0, vocab, (rows,))


def timing_row(shape: tuple[int, int, int], dtype: torch.dtype, trained: bool, repeats: int) -> list[str]:
    hidden, weight, target = operands(*shape, dtype, trained)

    def step(fn):
        def run() -> None:
            hidden.grad = weight.grad = None
            fn(hidden, weight, target).backward()

        return run

    fns = {"stock": step(stock), "fused": step(linear_cross_entropy)}
    peer = cut_cross_entropy()
    if peer is not None:
        fns["cce"] = step(peer)
    times = interleaved_times(fns, repeats=repeats, warmup=1)
    stock_s = sorted(times["stock"])[len(times["stock"]) // 2]
    ratio = lambda name: "{:.2f} ({:.2f}-{:.2f})".format(*paired_ratio(times[name], times["stock"]))
    return [
        "x".join(map(str, shape)), str(dtype).removeprefix("torch."), "trained" if trained else "frozen",
        f"{stock_s:.2f}", f"**{ratio('fused')}**", ratio("cce") if peer is not None else "not installed",
    ]  # fmt: skip


def precision_rows(smoke: bool) -> list[list[str]]:
    """A trained bf16 head's weight-gradient error against fp64 (relative norm), over stock's, by chunks."""
    from lightning_lowmem.ops import cross_entropy

    rows, vocab = (256, 64) if smoke else (4096, 256)
    hidden, weight, target = operands(rows, vocab, 64, torch.bfloat16, trained=True)
    exact = weight.detach().double().requires_grad_()
    F.cross_entropy(F.linear(hidden.detach().double(), exact), target).backward()
    error = lambda fn: ((_weight_grad(fn, weight) - exact.grad).norm() / exact.grad.norm()).item()
    stock_error = error(lambda: stock(hidden, weight, target))
    table, default = [], cross_entropy.chunk_rows
    try:
        for chunks in (1, 4, 16, 64, 256) if not smoke else (1, 4):
            cross_entropy.chunk_rows = lambda *_, chunks=chunks: rows // chunks
            errors = [error(lambda a=a: linear_cross_entropy(hidden, weight, target, accum_dtype=a))
                      for a in (torch.float32, None)]  # fmt: skip
            table.append([str(chunks), f"{errors[0] / stock_error:.2f}x", f"{errors[1] / stock_error:.2f}x"])
    finally:
        cross_entropy.chunk_rows = default
    return table


def _weight_grad(fn, weight: torch.Tensor) -> torch.Tensor:
    weight.grad = None
    fn().backward()
    return weight.grad.double()


def per_token_bytes(fn, shape: tuple[int, int, int], trained: bool) -> float:
    """Saved bytes per token: the slope between ``rows`` and twice as many."""
    rows, vocab, features = shape
    weight = (torch.randn(vocab, features) / features**0.5).requires_grad_(trained)
    saved = []
    for count in (rows, 2 * rows):
        hidden = torch.randn(count, features, requires_grad=True)
        with SavedTensorMeter() as meter:
            fn(hidden, weight, torch.randint(0, vocab, (count,)))
        saved.append(meter.total_bytes)
    return (saved[1] - saved[0]) / rows


def peak_rss_step(fused: bool, tokens: int) -> dict[str, float]:
    """One LoRA training step of a Qwen2-vocabulary LM in this (fresh) process: loss and peak RSS growth (MiB)."""
    import transformers

    from benchmarks import zoo
    from lightning_lowmem import apply_lowmem

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=151_936, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=tokens, tie_word_embeddings=False,
    )  # fmt: skip
    model = zoo.lora(transformers.Qwen2ForCausalLM(config), zoo.LLAMA_LINEARS)
    ids = torch.randint(0, 151_936, (1, tokens))
    if fused:
        apply_lowmem(model, activation=False, norm=False, gated=False, linear=False, dropout=False, measure=False,
                     verify=False, example_input={"input_ids": ids[:, :8], "labels": ids[:, :8]})  # fmt: skip
    model.train()
    before = _reset_peak_rss()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {"loss": loss.item(), "peak_mib": (_status_kib("VmHWM") - before) / 1024}


def _status_kib(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def _reset_peak_rss() -> int:
    """Reset the process's RSS high-water mark (Linux: ``clear_refs`` 5) to its current RSS, in KiB: the model's
    construction, which peaked higher than what is resident now, no longer counts."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one round, no RESULTS.md update")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rss", choices=("stock", "fused"), help=argparse.SUPPRESS)  # a worker: prints JSON
    parser.add_argument("--tokens", type=int, default=2048, help=argparse.SUPPRESS)
    args = parser.parse_args()
    warn_if_busy()
    if args.rss:
        print(json.dumps(peak_rss_step(args.rss == "fused", args.tokens)))
        return
    shapes = [(64, 1024, 32)] if args.smoke else SHAPES
    repeats = 1 if args.smoke else args.repeats
    peer = cut_cross_entropy()
    print(f"backend: {kernels.backend('cpu')}, threads: {torch.get_num_threads()}, cut-cross-entropy: "
          f"{'installed' if peer else 'not installed'}")  # fmt: skip
    rows = []
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            for trained in (False, True):
                rows.append(timing_row(shape, dtype, trained, repeats))
                print(" | ".join(rows[-1]), flush=True)
    speed = markdown_table(
        ["tokens x vocab x hidden", "dtype", "head", "stock s", "fused / stock (95%)", "Cut Cross-Entropy / stock"],
        rows,
    )
    memory_rows = []
    for trained in (False, True):
        shape = (64, 1024, 32) if args.smoke else (512, 32000, 512)
        fns = [linear_cross_entropy, stock] + ([peer] if peer is not None else [])
        ours, theirs, *cce = (per_token_bytes(fn, shape, trained) for fn in fns)
        memory_rows.append(
            ["trained" if trained else "frozen", f"{theirs:,.0f}", f"{ours:,.0f}", f"{ours / theirs:.2%}",
             f"{cce[0]:,.0f}" if cce else "not installed"]
        )  # fmt: skip
    memory = markdown_table(
        [
            "head (vocab 32,000, hidden 512, fp32)",
            "stock B/token",
            "fused B/token",
            "share",
            "Cut Cross-Entropy B/token",
        ],
        memory_rows,
    )
    precision = markdown_table(
        ["chunks", "error / stock's, accumulated in fp32 (default)", "in bf16 (`accum_dtype=None`)"],
        precision_rows(args.smoke),
    )
    tokens = 64 if args.smoke else args.tokens
    worker = [sys.executable, str(Path(__file__).resolve()), "--tokens", str(tokens), "--rss"]
    steps = {
        variant: json.loads(subprocess.run([*worker, variant], capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        for variant in ("stock", "fused")
    }  # fmt: skip
    rss = markdown_table(
        ["one LoRA step, Qwen2 vocabulary, " + f"{tokens} tokens", "loss", "peak RSS over the step's start, MiB"],
        [[variant, f"{s['loss']:.6f}", f"{s['peak_mib']:.0f}"] for variant, s in steps.items()],
    )
    print(speed, memory, precision, rss, sep="\n\n")
    if args.smoke:
        return
    body = (
        "## The fused linear + cross-entropy (language-model head)\n\n"
        f"Head and loss, forward and backward, {repeats} interleaved rounds per row (median of the per-round "
        'ratios, 95% bootstrap interval), beside Cut Cross-Entropy\'s compiled path (`impl="torch_compile"`) '
        "in the same rounds; the fused head computes its gradients in the forward, by chunks of 128 MiB of "
        "logits in the compute dtype.\n\n" + speed + "\n\nSaved for backward per token (the slope between 512 "
        "and 1024 tokens):\n\n" + memory + "\n\nA trained bf16 head's weight gradient against fp64 (4096 rows, "
        "vocabulary 256, hidden 64), its error over stock's, by the number of chunks its gradient is accumulated "
        "over:\n\n" + precision + "\n\nPeak RSS growth of one training step (a fresh process each; "
        "`logits x 4 B` = " + f"{tokens * 151_936 * 4 / 2**20:.0f} MiB):\n\n" + rss
    )
    write_section("cross_entropy", body, "python benchmarks/cross_entropy.py")


if __name__ == "__main__":
    main()
