"""One command for the day a GPU is lent: tests, op timings and training steps on the GPU.

1. Runs the GPU-marked tests (the Triton and CUDA C++ kernel backends on the GPU).
2. Times every op, forward + backward, against the stock op and against Liger Kernel's fused op
   where one exists (``pip install liger-kernel``; left out when absent), on each GPU backend.
3. Measures peak ``torch.cuda.max_memory_allocated`` and throughput of whole training steps
   (forward, backward, AdamW) at the paper's settings, bf16 autocast: ViT-B/16 at 224 px, batch 64
   (LoRA r=4 on q/v, LoRA on all linears, full fine-tuning) and a LLaMA-7B-shaped model (bf16
   weights, LoRA r=64 on all linears, batch 4 x 512); each stock, converted as the paper does
   (approximate activations and memory-sharing norms), with lightning-lowmem's defaults, and stock
   with activation checkpointing. Variants run one at a time (four 7B models do not fit at once).
4. Records the registers, spill bytes and configurations of every Triton kernel built for this GPU's
   architecture (``lightning_lowmem.kernels.triton_aot``: the builds the CI test compiles ahead of time).

Writes the "gpu" section of benchmarks/RESULTS.md. About 6 minutes on one H100.

    python -m benchmarks.gpu [--skip-tests] [--repeats N]
    python -m benchmarks.gpu --smoke    # tiny shapes on the CPU, no tests, no RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import zoo
from benchmarks.common import interleaved_median, markdown_table, write_section
from benchmarks.surgery import loss_of
from lightning_lowmem import apply_lowmem, functional, kernels
from lightning_lowmem.kernels import triton_aot
from lightning_lowmem.memory import MIB

ROOT = Path(__file__).resolve().parents[1]
VIT_LORA = {"LoRA r=4 q/v": ["qkv"], "LoRA r=4 all linears": ["qkv", "proj", "fc1", "fc2"], "full fine-tuning": None}
VARIANTS = {  # name -> apply_lowmem options, None for the stock model
    "stock": None,
    "paper (approx. activation + MS norm)": {"activation": True, "norm": True, "linear": False, "gated": False},
    "lightning-lowmem default": {},
    "stock + activation checkpointing": None,
}
CHECKPOINTED = "stock + activation checkpointing"


def gated(activation: str, mode: str) -> Callable:
    return lambda gate, up: functional.gated_activation(gate, up, activation, mode)


# name -> (shape at the paper's settings, stock op, {our op: function}, Liger Kernel's function name)
OPS = {
    "GELU": ((64, 197, 3072), F.gelu, {"ReGELU2": functional.regelu2}, None),
    "SiLU": ((4, 512, 11008), F.silu, {"ReSiLU2": functional.resilu2}, None),
    "LayerNorm": (
        (64, 197, 768),
        lambda x: F.layer_norm(x, x.shape[-1:]),
        {"MS-LN": lambda x: functional.ms_layer_norm(x, x.shape[-1:])},
        "liger_layer_norm",
    ),
    "RMSNorm": (
        (4, 512, 4096),
        lambda x: F.rms_norm(x, x.shape[-1:], eps=1e-6),
        {"MS-RMSNorm": lambda x: functional.ms_rms_norm(x, x.shape[-1:])},
        "liger_rms_norm",
    ),
    "SwiGLU product": (
        (4, 512, 11008),
        lambda gate, up: F.silu(gate) * up,
        {"fused, mode gate_up": gated("silu", "gate_up"), "fused, mode gate": gated("silu", "gate")},
        "liger_swiglu",
    ),
    "GeGLU (tanh) product": (
        (4, 512, 11008),
        lambda gate, up: F.gelu(gate, approximate="tanh") * up,
        {"fused, mode gate_up": gated("gelu_tanh", "gate_up"), "fused, mode gate": gated("gelu_tanh", "gate")},
        "liger_geglu",
    ),
}


@contextlib.contextmanager
def forced_backend(name: str | None, device: torch.device) -> Iterator[None]:
    """LIGHTNING_LOWMEM_BACKEND=name inside the block (None: unset) for the ops on ``device``, restored after."""
    old = os.environ.pop(kernels.ENV_VAR, None)
    if name is not None:
        os.environ[kernels.ENV_VAR] = name
    try:
        kernels.backend(device)  # the ops on the device follow the variable from the next choice on
        yield
    finally:
        os.environ.pop(kernels.ENV_VAR, None)
        if old is not None:
            os.environ[kernels.ENV_VAR] = old
        kernels.backend(device)


def usable_backends(device: torch.device) -> list[str]:
    """The compiled backends that run tensors on ``device`` here."""
    usable = []
    for name in ("triton", "cuda") if device.type == "cuda" else ("cpp", "triton"):
        try:
            with forced_backend(name, device):
                pass
        except RuntimeError as err:
            print(f"backend {name}: not measured ({str(err).splitlines()[0]})", flush=True)
        else:
            usable.append(name)
    return usable


def liger_op(name: str | None, dim: int, device: torch.device) -> Callable | None:
    """Liger Kernel's fused op (norms with a unit affine: Liger has no affine-free norm), if installed."""
    if name is None or device.type != "cuda":
        return None
    try:
        from liger_kernel.transformers import functional as liger
    except ImportError:
        return None
    op = getattr(liger, name)
    ones = torch.ones(dim, device=device, dtype=torch.bfloat16)
    if name == "liger_layer_norm":
        return lambda x: op(x, ones, torch.zeros_like(ones), 1e-5)
    if name == "liger_rms_norm":
        return lambda x: op(x, ones, 1e-6)
    return op


def time_ops(device: torch.device, backends: list[str], shrink: int, repeats: int) -> list[list[str]]:
    """fwd+bwd time of each op's implementations, interleaved; one row per implementation."""
    rows = []
    for name, (shape, stock, ours, liger_name) in OPS.items():
        shape = (*shape[:-1], shape[-1] // shrink)
        n_inputs = 2 if name.endswith("product") else 1
        inputs = [torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(n_inputs)]
        grad = torch.randn(shape, device=device, dtype=torch.bfloat16)

        def fwd_bwd(fn: Callable, backend: str | None = None, inputs=inputs, grad=grad) -> Callable[[], object]:
            def run() -> object:
                with forced_backend(backend, device):
                    return torch.autograd.grad(fn(*inputs), inputs, grad)

            return run

        candidates = {"stock": fwd_bwd(stock)}
        candidates |= {f"{op} ({b})": fwd_bwd(fn, b) for op, fn in ours.items() for b in backends}
        liger = liger_op(liger_name, shape[-1], device)
        if liger is not None:
            candidates["Liger Kernel"] = fwd_bwd(liger)
        times = interleaved_median(candidates, repeats=repeats)
        for implementation, seconds in times.items():
            ratio = f"{seconds / times['stock']:.2f}"
            rows.append([name, "x".join(map(str, shape)), implementation, f"{seconds * 1e3:.3f}", ratio])
            print(" | ".join(rows[-1]), flush=True)
    return rows


def vit_b16(targets: list[str] | None, smoke: bool) -> nn.Module:
    tiny = {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 64, "num_heads": 2} if smoke else {}
    model = zoo.vit("vit_base_patch16_224", tiny=False, **tiny)
    return model if targets is None else zoo.lora(model, targets)


def llama_7b(smoke: bool) -> nn.Module:
    """LLaMA-7B shapes (transformers' LlamaConfig defaults), bf16 weights, LoRA r=64 on every linear."""
    tiny = {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = zoo.llama(tiny=False, use_cache=False, **({"vocab_size": 256, **tiny} if smoke else {}))
    finally:
        torch.set_default_dtype(default)
    return zoo.lora(model, zoo.LLAMA_LINEARS, r=64, lora_alpha=128)


def enable_checkpointing(model: nn.Module) -> None:
    """Recompute every transformer block in backward (timm and Hugging Face switches, non-reentrant)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "set_grad_checkpointing"):
        base.set_grad_checkpointing(True)
    else:  # transformers 5 renamed the switch
        enable = getattr(base, "activation_checkpointing_enable", None) or base.gradient_checkpointing_enable
        enable({"use_reentrant": False})


def train_step(model: nn.Module, batch: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step() -> None:
        with torch.autocast(batch.device.type, dtype=torch.bfloat16):
            loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure_training(build: Callable[[], nn.Module], batch: torch.Tensor, variant: str, repeats: int) -> tuple:
    """Peak MiB of one step (None off a GPU) and steps per second, for one variant built afresh."""
    torch.manual_seed(0)
    with batch.device:  # initialised in place: a 7B model built on the CPU first takes minutes
        model = build().train()
    if variant == CHECKPOINTED:
        enable_checkpointing(model)
    elif VARIANTS[variant] is not None:
        apply_lowmem(model, example_input=batch, verify=False, measure=False, **VARIANTS[variant])
    step = train_step(model, batch)
    step()  # warm-up: optimizer state, kernel compilation
    peak = None
    if batch.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = torch.cuda.max_memory_allocated() / MIB
    seconds = interleaved_median({"step": step}, repeats=repeats, warmup=0)["step"]
    del model, step
    gc.collect()
    if batch.is_cuda:
        torch.cuda.empty_cache()
    return peak, 1 / seconds


def measure_models(device: torch.device, smoke: bool, repeats: int) -> list[list[str]]:
    size, images, tokens = (32, 2, (2, 16)) if smoke else (224, 64, (4, 512))
    vit_settings = list(VIT_LORA.items())[: 1 if smoke else None]  # the smoke run checks the script, not numbers
    settings = {f"ViT-B/16 {name}": (lambda t=t: vit_b16(t, smoke), "images") for name, t in vit_settings}
    settings["LLaMA-7B shape, LoRA r=64 all linears"] = (lambda: llama_7b(smoke), "tokens")
    batches = {
        "images": torch.randn(images, 3, size, size, device=device),
        "tokens": torch.randint(0, 256, tokens, device=device),
    }
    rows = []
    for setting, (build, unit) in settings.items():
        batch = batches[unit]
        per_step = batch.shape[0] if unit == "images" else batch.numel()
        stock_peak = stock_rate = None
        for variant in VARIANTS:
            peak, rate = measure_training(build, batch, variant, repeats)
            stock_peak, stock_rate = stock_peak or peak, stock_rate or rate
            memory = "n/a (no GPU)" if peak is None else f"{peak:,.0f} ({100 * (peak / stock_peak - 1):+.0f}%)"
            rows.append([setting, variant, memory, f"{per_step * rate:,.1f} {unit}/s", f"{rate / stock_rate:.2f}"])
            print(" | ".join(rows[-1]), flush=True)
    return rows


def run_gpu_tests() -> str:
    """``pytest -m gpu``, its output streamed; returns pytest's summary line."""
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = ""
    for line in process.stdout:
        print(line, end="", flush=True)
        last = line.strip() or last
    process.wait()
    return last


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per measurement")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the GPU-marked tests")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks this script only")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke)")
    device = torch.device("cpu" if args.smoke else "cuda")
    repeats = 1 if args.smoke else args.repeats
    tests = "not run" if args.smoke or args.skip_tests else run_gpu_tests()
    print(f"GPU tests: {tests}", flush=True)
    backends = usable_backends(device)
    print(f"default backend on {device.type}: {kernels.backend(device)}; measured: {', '.join(backends)}", flush=True)
    op_table = markdown_table(
        ["op", "shape (bf16)", "implementation", "fwd+bwd ms", "vs stock"],
        time_ops(device, backends, shrink=64 if args.smoke else 1, repeats=2 * repeats),
    )
    model_table = markdown_table(
        ["model, setting", "variant", "peak MiB (change)", "throughput", "vs stock"],
        measure_models(device, args.smoke, repeats),
    )
    print(op_table + "\n\n" + model_table)
    if args.smoke:
        return
    major, minor = torch.cuda.get_device_capability(device)
    builds = triton_aot.table(triton_aot.compile_all([10 * major + minor]))
    print(builds)
    body = (
        "## GPU: kernels and whole training steps\n\n"
        f"GPU-marked tests: {tests}. Default backend for CUDA tensors: `{kernels.backend(device)}`.\n\n"
        "### Ops, forward + backward (median of interleaved runs)\n\nStock norms are affine-free like ours; "
        "Liger Kernel's norms apply a unit affine (they have no affine-free form).\n\n"
        f"{op_table}\n\n### Training steps (bf16 autocast, AdamW; each variant built afresh, one at a time, "
        f"median of {repeats} steps)\n\n{model_table}\n\n### Triton kernel builds for this GPU (sm_{major}{minor}; "
        f"every configuration the launchers can choose)\n\n{builds}"
    )
    write_section("gpu", body, "python -m benchmarks.gpu")


if __name__ == "__main__":
    main()
