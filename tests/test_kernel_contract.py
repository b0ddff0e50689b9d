"""What a declaration (kernels.library.declare) cannot guarantee by itself: that the compiled backends register
the declared operators, the Triton functions take their declarations' arguments, and every kernel knows the
activation kinds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lightning_lowmem import kernels
from lightning_lowmem.kernels import build, library, torch_ops
from lightning_lowmem.registry.activations import ACTIVATIONS

CSRC = Path(__file__).resolve().parent.parent / "csrc"


def test_every_declared_op_says_what_it_computes_and_is_its_own_operator():
    for name, declared in library.DECLARED.items():
        assert declared.reference is getattr(torch_ops, name) and len(declared.reference.__doc__ or "") > 40, name
        assert str(getattr(library.OPS, name).default._schema) == f"lowmem::{name}{declared.schema}"


def test_the_compiled_backends_register_declared_ops_and_the_rest_run_the_reference():
    """csrc/lowmem_bind.cpp is built twice, for the CPU and (with LOWMEM_CUDA) the CUDA key; an op a build does
    not register runs the reference (the operators' CompositeExplicitAutograd kernel)."""
    registered = set(re.findall(r'm\.impl\("(\w+)"', (CSRC / "lowmem_bind.cpp").read_text()))
    assert registered <= set(library.DECLARED)
    if isinstance(build.load("cpu"), build.BuildError) or kernels.backend("cpu") != "cpp":
        pytest.skip("the CPU extension is not built here")
    on_cpu = {op for op in library.DECLARED if torch._C._dispatch_has_kernel_for_dispatch_key(f"lowmem::{op}", "CPU")}
    assert on_cpu == registered
    for op in library.DECLARED.keys() - registered:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"lowmem::{op}", "CompositeExplicitAutograd"), op


def test_a_triton_kernel_that_takes_other_arguments_than_its_declaration_is_refused():
    triton_ops = pytest.importorskip("lightning_lowmem.kernels.triton_ops")
    for name in library.DECLARED.keys() & vars(triton_ops).keys():  # registered as they are: same arguments
        library._fp64_by_reference(getattr(triton_ops, name), library.DECLARED[name])

    def act_codes(x, thresholds, bits):  # one argument too many
        return x

    with pytest.raises(TypeError, match=r"act_codes must take the arguments of its declaration, \('x', 'thresholds'\)"):
        library._fp64_by_reference(act_codes, library.DECLARED["act_codes"])


def test_a_float64_call_to_a_triton_operator_runs_the_reference():
    calls = []
    kernel = library._fp64_by_reference(lambda x, thresholds: calls.append(x.dtype), library.DECLARED["act_codes"])
    x = torch.randn(8, dtype=torch.float64)
    assert torch.equal(kernel(x, [0.0]), torch_ops.act_codes(x, [0.0])) and not calls
    kernel(x.float(), [0.0])
    assert calls == [torch.float32]


def test_the_kernels_know_the_activations_the_registry_gives_kernel_ids():
    ids = {entry.kernel for entry in ACTIVATIONS.values() if entry.kernel is not None}
    assert set(torch_ops.KINDS) == ids
    listed = re.search(r"#define LOWMEM_ACTIVATIONS\(X\)(.*?)\n\n", (CSRC / "lowmem_math.h").read_text(), re.DOTALL)
    assert set(re.findall(r'X\(\w+, "(\w+)"\)', listed.group(1))) == ids
    for backend in (torch_ops, torch.ops.lowmem):
        with pytest.raises(ValueError, match="unknown activation kind 'mish'; expected one of"):
            backend.act_forward(torch.ones(4), "mish", [0.0])
