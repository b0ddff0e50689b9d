"""Stage ``models``: training steps at real dims on the device, stock against converted.

``models``: one decoder layer of LLaMA-2-7B and of Llama-3-8B (each with its embedding, head and loss: labels
passed), ViT-B/16 and BERT-base at full depth; bf16 weights, peft LoRA r=16 on every linear with ``lora_dropout``
0.05 (fp32 adapters), bf16 autocast, AdamW. Per model: the peak of a training step
(``torch.cuda.max_memory_allocated`` above what was allocated before it: the peak users see), the bytes one forward
saves for backward, and the step time by CUDA events, both models' steps interleaved, the median of the per-round
ratios with its 95% bootstrap interval. The saved bytes predict the peak's change: the note says where it differs.

The steps are timed eagerly here; :func:`measure_graphs` (the ``graphs`` stage, the run's last: a failed capture
leaves the CUDA generator refusing every later random op in the process) times them with forward and backward
captured as CUDA graphs (``make_graphed_callables``: what host time costs shows as the difference).

``compile`` (in the ``models`` stage's file): a converted LoRA LLaMA (2 layers at LLaMA-2-7B's dims) under
``torch.compile(fullgraph=True)``: it compiles, its loss is eager's, and its step time against eager's and the
compiled stock model's.
"""

from __future__ import annotations

import copy
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks.common import interleaved_times, markdown_table, paired_ratio
from benchmarks.real_scale import CONFIGS, RECIPES, SMOKE, Config, build, example
from lightning_lowmem import apply_lowmem
from lightning_lowmem.memory import MIB, SavedTensorMeter

GIB = float(1 << 30)
PROFILE_ABOVE = 1.05  # the bound on converted / stock step time


@dataclass(frozen=True)
class Setting:
    config: str
    layers: int | None  # None: the model's own depth
    tokens: int  # per row (images: the batch)
    rows: int = 1


SETTINGS = {
    "LLaMA-2-7B, 1 layer + head, LoRA r=16": Setting("LLaMA-2-7B", 1, 4096),
    "Llama-3-8B, 1 layer + head (vocabulary 128,256), LoRA r=16": Setting("Llama-3-8B", 1, 4096),
    "ViT-B/16 (224 px), LoRA r=16": Setting("ViT-B/16 (224 px)", None, 64),
    "BERT-base, LoRA r=16": Setting("BERT-base", None, 512, rows=32),
}
SHORT = {  # the 8-minute run: smaller batches, the same dims
    "LLaMA-2-7B, 1 layer + head, LoRA r=16": Setting("LLaMA-2-7B", 1, 2048),
    "Llama-3-8B, 1 layer + head (vocabulary 128,256), LoRA r=16": Setting("Llama-3-8B", 1, 2048),
    "ViT-B/16 (224 px), LoRA r=16": Setting("ViT-B/16 (224 px)", None, 32),
    "BERT-base, LoRA r=16": Setting("BERT-base", None, 512, rows=8),
}


def batch_for(config: Config, setting: Setting, device: torch.device) -> Any:
    """The input, on ``device``: token ids (with labels for a causal LM) or images."""
    if config.family == "vit":
        x, _ = example(config, 0, images=setting.tokens)
    else:
        x, _ = example(config, setting.tokens)
        x = {k: v.repeat(setting.rows, 1) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    return x.to(device) if isinstance(x, torch.Tensor) else {k: _to(v, device) for k, v in x.items()}


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def loss(model: nn.Module, x: Any) -> torch.Tensor:
    out = model(**x) if isinstance(x, dict) else model(x)
    if getattr(out, "loss", None) is not None:
        return out.loss
    logits = out if isinstance(out, torch.Tensor) else (out.logits if hasattr(out, "logits") else out[0])
    return logits.float().square().mean()


def training_step(model: nn.Module, x: Any) -> Callable[[], torch.Tensor]:
    """One step: bf16-autocast forward, backward, AdamW on the trainable parameters."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    device = next(model.parameters()).device.type

    def step() -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16):
            value = loss(model, x)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return value.detach()

    return step


class _LossOf(nn.Module):
    """The loss of ``model`` on the tensors of a batch passed positionally (what CUDA-graph capture takes), the
    batch's other values (``use_cache=False``) kept as constants."""

    def __init__(self, model: nn.Module, keys: list[str] | None, constants: dict[str, Any]) -> None:
        super().__init__()
        self.model, self.keys, self.constants = model, keys, constants

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return loss(self.model, dict(zip(self.keys, tensors)) | self.constants if self.keys else tensors[0])


def graphed_step(model: nn.Module, x: Any) -> Callable[[], torch.Tensor]:
    """:func:`training_step` with forward and backward captured once as CUDA graphs and replayed
    (``torch.cuda.make_graphed_callables``): the host issues two graph launches where it issued every kernel."""
    batch = x if isinstance(x, dict) else {}
    keys = [k for k, v in batch.items() if isinstance(v, torch.Tensor)] if batch else None
    constants = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}
    tensors = tuple(x[k] for k in keys) if keys else (x,)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        graphed = torch.cuda.make_graphed_callables(_LossOf(model, keys, constants), tensors)

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            value = graphed(*tensors)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return value.detach()

    return step


def step_peak(step: Callable[[], object], device: torch.device) -> float:
    """Bytes a step allocates at its peak above what was allocated before it (0 off a GPU)."""
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return float(torch.cuda.max_memory_allocated(device) - before)


def saved(model: nn.Module, x: Any) -> int:
    with torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16), SavedTensorMeter(model) as meter:
        loss(model, x)
    return meter.total_bytes


def build_on(config: Config, layers: int | None, device: torch.device) -> nn.Module:
    """The model at its real dims built on ``device`` (initialised there: no host copy of the weights)."""
    with tempfile.TemporaryDirectory() as directory, device:
        return build(config, layers or config.layers, "lora", directory)


def measure_models(device: torch.device, settings: dict[str, Setting], rounds: int, smoke: bool) -> str:
    """Each model stock and converted (markdown); rows printed as they come."""
    rows, profiles = [], []
    for name, setting in settings.items():
        try:
            row, profile = measure_model(name, setting, device, rounds, smoke)
            rows.append(row)
            profiles += (
                [f"Where the time went in {name} (one step each, by self time):\n\n{profile}"] if profile else []
            )
        except Exception as err:  # noqa: BLE001 - written in its row: the next model still runs
            rows.append([name, f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}", *[""] * 8])
            _release(device)
        print(" | ".join(map(str, rows[-1])), flush=True)
    header = [
        "model (bf16, LoRA r=16 all linears, dropout 0.05)", "stock peak MiB", "converted peak MiB",
        "peak saved MiB", "stock saved-for-backward MiB", "converted saved-for-backward MiB",
        "saved-bytes saving MiB (the prediction)", "stock step (median)", f"converted / stock step ({rounds} rounds)",
        "measured in",
    ]  # fmt: skip
    return "\n\n".join([markdown_table(header, rows), *profiles])


def measure_model(
    name: str, setting: Setting, device: torch.device, rounds: int, smoke: bool
) -> tuple[list[str], str | None]:
    """One model's row (peaks, saved bytes, step times) and, if its converted step is slower than
    ``PROFILE_ABOVE`` times stock's (always in a smoke run, to rehearse it), the ops whose time grew most."""
    started = time.perf_counter()
    config = CONFIGS[setting.config]
    if smoke:  # one ViT-B/16 block on 2 images; the tiny LLaMA for the rest
        config = config if config.family == "vit" else SMOKE["tiny LLaMA"]
        setting = Setting(setting.config, 1, 2 if config.family == "vit" else 64)
    x = batch_for(config, setting, device)
    stock = build_on(config, setting.layers, device)
    converted = copy.deepcopy(stock)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        apply_lowmem(converted, example_input=x, verify=True, measure=False)
    steps = {"stock": training_step(stock, x), "converted": training_step(converted, x)}
    for step in steps.values():
        step()  # the optimizer's state, kernels' compilation and autotuning
    peaks = {variant: step_peak(step, device) for variant, step in steps.items()}
    saved_bytes = {"stock": saved(stock, x), "converted": saved(converted, x)}
    times = interleaved_times(steps, repeats=rounds, warmup=1, cuda_events=device.type == "cuda")
    ratio, low, high = paired_ratio(times["converted"], times["stock"])
    slower = ratio > PROFILE_ABOVE or smoke
    profile = (
        profile_table({variant: step_profile(step, device) for variant, step in steps.items()}) if slower else None
    )
    del stock, converted, steps
    _release(device)
    row = [
        name, _mib(peaks["stock"]), _mib(peaks["converted"]), _mib(peaks["stock"] - peaks["converted"]),
        _mib(saved_bytes["stock"]), _mib(saved_bytes["converted"]),
        _mib(saved_bytes["stock"] - saved_bytes["converted"]),
        f"{1e3 * statistics.median(times['stock']):.1f} ms", f"{ratio:.3f} ({low:.3f}-{high:.3f})",
        f"{time.perf_counter() - started:.0f} s",
    ]  # fmt: skip
    return row, profile


def measure_graphs(device: torch.device, settings: dict[str, Setting], rounds: int) -> str:
    """Each model's step, stock and converted, with forward and backward captured as CUDA graphs (markdown); run
    last, since a failed capture leaves the process's CUDA generator unusable."""
    rows = []
    for name, setting in settings.items():
        config = CONFIGS[setting.config]
        try:
            x = batch_for(config, setting, device)
            stock = build_on(config, setting.layers, device)
            converted = copy.deepcopy(stock)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                apply_lowmem(converted, example_input=x, verify=True, measure=False)
            graphs = {"stock": graphed_step(stock, x), "converted": graphed_step(converted, x)}
            times = interleaved_times(graphs, repeats=rounds, warmup=2, cuda_events=True)
            ratio, low, high = paired_ratio(times["converted"], times["stock"])
            rows.append(
                [name, f"{1e3 * statistics.median(times['stock']):.1f} ms", f"{ratio:.3f} ({low:.3f}-{high:.3f})"]
            )
            del stock, converted, graphs
        except Exception as err:  # noqa: BLE001 - written in its row: the next model is still tried
            rows.append([name, f"capture failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}", ""])
        _release(device)
        print(" | ".join(rows[-1]), flush=True)
    header = [
        "model (as in the models stage)",
        "stock step, CUDA graphs (median)",
        f"converted / stock ({rounds} rounds)",
    ]
    return markdown_table(header, rows)


def step_profile(step: Callable[[], object], device: torch.device) -> dict[str, tuple[int, float]]:
    """Each op's or kernel's calls and self time (seconds) in one step: on a GPU the kernels' device time."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as profiler:
        step()
        if on_gpu:
            torch.cuda.synchronize(device)
    found = {}
    for event in profiler.key_averages():
        seconds = (event.self_device_time_total if on_gpu else event.self_cpu_time_total) / 1e6
        if seconds > 0:
            found[event.key] = (event.count, seconds)
    return found


def profile_table(profiles: dict[str, dict[str, tuple[int, float]]], rows: int = 12) -> str:
    """The ``rows`` ops whose self time grew most from stock to converted, and the totals (markdown)."""
    stock, converted = profiles["stock"], profiles["converted"]
    absent = (0, 0.0)

    def grown(key: str) -> float:
        return converted.get(key, absent)[1] - stock.get(key, absent)[1]

    table = []
    for key in sorted(stock.keys() | converted.keys(), key=grown, reverse=True)[:rows]:
        (stock_calls, stock_seconds), (calls, seconds) = stock.get(key, absent), converted.get(key, absent)
        table.append([f"`{key[:80]}`", stock_calls, f"{1e3 * stock_seconds:.2f}", calls, f"{1e3 * seconds:.2f}",
                      f"{1e3 * grown(key):+.2f}"])  # fmt: skip
    totals = [sum(seconds for _, seconds in profile.values()) for profile in (stock, converted)]
    table.append(
        ["all", "", f"{1e3 * totals[0]:.2f}", "", f"{1e3 * totals[1]:.2f}", f"{1e3 * (totals[1] - totals[0]):+.2f}"]
    )
    header = ["op or kernel", "stock calls", "stock ms", "converted calls", "converted ms", "converted - stock ms"]
    return markdown_table(header, table)


def measure_compile(device: torch.device, rounds: int, smoke: bool) -> str:
    """A converted LoRA LLaMA compiled whole (markdown)."""
    config = SMOKE["tiny LLaMA"] if smoke else CONFIGS["LLaMA-2-7B"]
    setting = Setting(config.name, 2, 64 if smoke else 2048)
    x = batch_for(config, setting, device)
    lora = RECIPES["lora"][1]
    kept, lora["lora_dropout"] = lora["lora_dropout"], 0.0  # the compiled and eager losses then compare exactly
    try:
        stock = build_on(config, setting.layers, device)
    finally:
        lora["lora_dropout"] = kept
    converted = copy.deepcopy(stock)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        apply_lowmem(converted, example_input=x, verify=True, measure=False)
    eager = training_step(copy.deepcopy(converted), x)
    started = time.perf_counter()
    compiled_step = training_step(torch.compile(converted, fullgraph=True), x)
    compiled_loss = compiled_step()
    compile_seconds = time.perf_counter() - started
    eager_loss = eager()
    stock_compiled = training_step(torch.compile(stock, fullgraph=True), x)
    stock_compiled()
    times = interleaved_times(
        {"compiled": compiled_step, "eager": eager, "stock compiled": stock_compiled},
        repeats=rounds, warmup=1, cuda_events=device.type == "cuda",
    )  # fmt: skip
    rows = []
    for name in ("eager", "stock compiled"):
        ratio, low, high = paired_ratio(times["compiled"], times[name])
        rows.append([f"converted, compiled / {name}", f"{ratio:.3f} ({low:.3f}-{high:.3f})"])
    difference = abs(compiled_loss.item() - eager_loss.item()) / max(abs(eager_loss.item()), 1e-30)
    del stock, converted
    _release(device)
    return (
        f"{config.name} dims, 2 layers, LoRA r=16 on every linear (dropout 0 for the comparison), 1 x "
        f"{setting.tokens} tokens, bf16 autocast: `torch.compile(fullgraph=True)` of the converted model compiled "
        f"and ran its first step in {compile_seconds:.0f} s; first-step loss {compiled_loss.item():.6f} compiled vs "
        f"{eager_loss.item():.6f} eager (relative difference {difference:.1e}); compiled step "
        f"{1e3 * statistics.median(times['compiled']):.1f} ms (median of {rounds}).\n\n"
        + markdown_table(["ratio", "median (95% interval)"], rows)
    )


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:,.1f}"


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
