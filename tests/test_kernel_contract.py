"""Every kernel backend implements the contract of lightning_lowmem.kernels.contract, op by op."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from lightning_lowmem import kernels
from lightning_lowmem.kernels import build, library, torch_ops
from lightning_lowmem.kernels.contract import KernelContract
from lightning_lowmem.registry.activations import ACTIVATIONS

CONTRACT = sorted(
    name for name, _ in inspect.getmembers(KernelContract, inspect.isfunction) if not name.startswith("_")
)
CSRC = Path(__file__).resolve().parent.parent / "csrc"


def parameters(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def test_the_contract_lists_every_op_and_the_operators_add_only_the_opaque_stock_activation():
    assert CONTRACT == sorted(
        [
            "act_codes",
            "act_forward",
            "act_backward",
            "norm_forward",
            "norm_affine_forward",
            "norm_backward",
            "norm_exact_columns",
            "norm_output_forward",
            "norm_output_backward",
            "gated_exceptions",
            "gated_backward",
            "dropout",
            "dropout_input_and_grad",
            "affine_weight_grad",
            "cross_entropy_grad_",
        ]
    )
    assert set(library.SCHEMAS) == {*CONTRACT, "stock_activation"}


@pytest.mark.parametrize("op", CONTRACT)
def test_the_operator_schema_and_the_python_backends_take_the_contracts_arguments(op):
    expected = parameters(getattr(KernelContract, op))
    assert [a.name for a in getattr(torch.ops.lowmem, op).default._schema.arguments] == expected
    assert parameters(getattr(torch_ops, op)) == expected
    triton_ops = pytest.importorskip("lightning_lowmem.kernels.triton_ops")
    assert parameters(getattr(triton_ops, op)) == expected


def test_the_compiled_backends_register_only_contract_ops_and_the_cpu_one_all_of_them():
    """csrc/lowmem_bind.cpp is built twice, for the CPU and (with LOWMEM_CUDA) the CUDA key; an op a build does
    not register runs the reference (the operators' CompositeExplicitAutograd kernel)."""
    registered = re.findall(r'm\.impl\("(\w+)"', (CSRC / "lowmem_bind.cpp").read_text())
    assert set(registered) <= set(CONTRACT)
    if isinstance(build.load("cpu"), build.BuildError) or kernels.backend("cpu") != "cpp":
        pytest.skip("the CPU extension is not built here")
    for op in CONTRACT:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"lowmem::{op}", "CPU"), op


def test_the_kernels_know_the_activations_the_registry_gives_kernel_ids():
    ids = {entry.kernel for entry in ACTIVATIONS.values() if entry.kernel is not None}
    assert set(torch_ops.KINDS) == ids
    listed = re.search(r"#define LOWMEM_ACTIVATIONS\(X\)(.*?)\n\n", (CSRC / "lowmem_math.h").read_text(), re.DOTALL)
    assert set(re.findall(r'X\(\w+, "(\w+)"\)', listed.group(1))) == ids
    for backend in (torch_ops, torch.ops.lowmem):
        with pytest.raises(ValueError, match="unknown activation kind 'mish'; expected one of"):
            backend.act_forward(torch.ones(4), "mish", [0.0])
