"""The kernels as PyTorch operators, ``torch.ops.lowmem.*``: seen by the dispatcher and by torch.compile.

One schema per function of the kernel contract (:mod:`.contract`). Who computes an operator is
the dispatcher's business:

- the C++ extensions register the ``CPU`` and ``CUDA`` kernels (``TORCH_LIBRARY_IMPL`` in
  ``csrc/lowmem_bind.cpp``) when :mod:`.build` loads them;
- the pure-PyTorch reference is the ``CompositeExplicitAutograd`` kernel: it runs on a device
  with no compiled kernel registered (before the extension loads, or where it cannot be built);
- ``stock_activation`` is the stock ATen activation behind an opaque operator, for a backward
  that must recompute the very bits its forward computed (the gated product's): torch.compile
  can neither merge it with the forward's activation (which the partitioner would then save)
  nor replace it with generated code that rounds differently;
- the fake kernels give shapes and dtypes without computing anything, so ``torch.compile``
  traces the ops as single graph nodes (no graph break) and ``torch.library.opcheck`` passes.

The Triton kernels are the same operators in a namespace of their own, ``torch.ops.lowmem_triton`` (defined when
Triton is first chosen, :func:`triton_operators`): so torch.compile sees every Triton kernel as one graph node
with the same fake kernel, never the Python of its launcher.

These operators have no autograd formula of their own: the autograd functions of
:mod:`lightning_lowmem.ops` call them in their forward and backward. Five more, ``ms_norm``,
``affine_linear``, ``seeded_dropout``, ``step_activation`` and ``gated_activation`` (:data:`AUTOGRAD_SCHEMAS`), are
those autograd functions in C++ (``csrc/lowmem_autograd.cpp``, registered for the extension's Autograd key): the ops layer
calls them in eager mode where a compiled extension serves the device, so that no Python runs per
call in forward or backward, and their dropouts draw their seeds from the device's generator in C++, as ATen's
dropout does (no seed tensor drawn by an operator of its own). They have no other kernel: torch.compile, Triton
and the pure-PyTorch backend use the Python functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from lightning_lowmem.kernels import torch_ops

NAMESPACE = "lowmem"
SCHEMAS = {
    "act_codes": "(Tensor x, float[] thresholds) -> Tensor",
    "act_forward": "(Tensor x, str kind, float[] thresholds) -> (Tensor, Tensor)",
    "act_backward": "(Tensor grad, Tensor packed, float[] levels) -> Tensor",
    "norm_forward": "(Tensor x, int dim, float eps, bool center, ScalarType out_dtype) -> (Tensor, Tensor)",
    "norm_affine_forward": (
        "(Tensor x, int dim, float eps, bool center, ScalarType out_dtype, Tensor? scale, Tensor? shift)"
        " -> (Tensor, Tensor, Tensor)"
    ),
    "norm_backward": (
        "(Tensor grad, Tensor z, Tensor rstd, Tensor? scale, int dim, bool center, ScalarType dtype, bool column_sums)"
        " -> (Tensor, Tensor)"
    ),
    "norm_exact_columns": "(Tensor? scale, Tensor? shift) -> Tensor",
    "norm_output_forward": (
        "(Tensor x, int dim, float eps, bool center, ScalarType out_dtype, Tensor? scale, Tensor? shift,"
        " Tensor columns) -> (Tensor, Tensor, Tensor)"
    ),
    "norm_output_backward": (
        "(Tensor grad, Tensor y, Tensor rstd, Tensor? scale, Tensor? shift, Tensor columns, Tensor exact, int dim,"
        " bool center, ScalarType dtype) -> Tensor"
    ),
    "gated_exceptions": "(Tensor act, Tensor up, int slots) -> (Tensor, Tensor)",
    "gated_backward": (
        "(Tensor grad, Tensor gate, Tensor second, str kind, Tensor? act, Tensor? columns=None, Tensor? up_at=None)"
        " -> (Tensor, Tensor)"
    ),
    "stock_activation": "(Tensor x, str kind) -> Tensor",
    "dropout": "(Tensor x, float p, Tensor seed) -> Tensor",
    "dropout_input_and_grad": (
        "(Tensor x, Tensor? scale, Tensor? shift, ScalarType dtype, Tensor grad, float p, Tensor seed) -> (Tensor, Tensor)"
    ),
    "affine_weight_grad": (
        "(Tensor product, Tensor? total, Tensor? scale, Tensor? shift, ScalarType dtype) -> Tensor"
    ),
    "cross_entropy_grad_": (
        "(Tensor(a!) logits, Tensor target, int ignore_index, float label_smoothing, float softcap,"
        " Tensor? row_scale=None) -> Tensor"
    ),
}

CPU_ONLY = ("norm_exact_columns", "norm_output_forward", "norm_output_backward", "cross_entropy_grad_")
"""The operators the CUDA extension has no kernel for: on a GPU a frozen norm saves ``z`` (its exact columns would be
counted on the host, :mod:`lightning_lowmem.ops.norm`), and a fused head runs Triton's cross-entropy."""

AUTOGRAD_SCHEMAS = {
    "ms_norm": (
        "(Tensor x, Tensor? weight, Tensor? bias, int max_exact_columns, int dim, float eps, bool center,"
        " ScalarType out_dtype, float offset, str name) -> (Tensor, Tensor)"
    ),
    "affine_linear": (
        "(Tensor x, Tensor? z, Tensor weight, Tensor? bias, Tensor? gamma, Tensor? beta, ScalarType dtype, float offset,"
        " float p, Tensor? dropped) -> Tensor"
    ),
    "seeded_dropout": "(Tensor x, float p) -> (Tensor, Tensor)",
    "step_activation": "(Tensor x, str kind, float[] thresholds, float[] levels, str name) -> Tensor",
    "gated_activation": "(Tensor gate, Tensor up, str kind, bool recover_up, int slots) -> Tensor",
}

TRITON_NAMESPACE = "lowmem_triton"


def _define(namespace: str, schemas: dict[str, str], kernels: ModuleType) -> torch.library.Library:
    """A library of the operators ``schemas`` names, each computed by the function of that name in ``kernels`` on
    any device (``CompositeExplicitAutograd``), with the fake kernel of ``lowmem``'s operator of that name."""
    library = torch.library.Library(namespace, "DEF")
    for name, schema in schemas.items():
        library.define(name + schema)
        library.impl(name, getattr(kernels, name), "CompositeExplicitAutograd")
        if namespace != NAMESPACE:
            torch.library.register_fake(f"{namespace}::{name}", _FAKES[name], lib=library)
    return library


def _fake(name: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as the fake kernel of ``lowmem::name`` (and of its twins in other
    namespaces, :func:`triton_operators`)."""

    def register(fake: Callable) -> Callable:
        @functools.wraps(fake)
        def on_one_device(*args: Any) -> Any:
            _check_one_device(name, args)
            return fake(*args)

        _FAKES[name] = on_one_device
        return torch.library.register_fake(f"{NAMESPACE}::{name}", on_one_device, lib=_LIBRARY)

    return register


def _check_one_device(name: str, args: tuple) -> None:
    """Every tensor argument on the first one's device, as the kernels check: a meta tensor among real ones sends
    the call here (the Meta key outranks the others), which would otherwise return an empty tensor as the result."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    for tensor in tensors[1:]:
        if tensor.device != tensors[0].device:
            raise RuntimeError(
                f"{name}: every tensor must be on {tensors[0].device} with the first, got one on {tensor.device}"
            )


_FAKES: dict[str, Callable] = {}
_LIBRARY = _define(NAMESPACE, SCHEMAS, torch_ops)
for _name, _schema in AUTOGRAD_SCHEMAS.items():
    _LIBRARY.define(_name + _schema)


@_fake("act_codes")
def _act_codes_fake(x: torch.Tensor, thresholds: list[float]) -> torch.Tensor:
    bits = torch_ops.storage_bits(len(thresholds))
    return x.new_empty(torch_ops.packed_bytes(x.numel(), bits), dtype=torch.uint8)


@_fake("act_forward")
def _act_forward_fake(x: torch.Tensor, kind: str, thresholds: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), _act_codes_fake(x, thresholds)


@_fake("act_backward")
def _act_backward_fake(grad: torch.Tensor, packed: torch.Tensor, levels: list[float]) -> torch.Tensor:
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


@_fake("norm_forward")
def _norm_forward_fake(
    x: torch.Tensor, dim: int, eps: float, center: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(dim > 0 and x.numel() % dim == 0, lambda: f"norm_forward: cannot normalize over {dim} elements")
    z = x.new_empty(x.shape, dtype=out_dtype)
    return z, x.new_empty(x.numel() // dim, dtype=torch_ops.accumulate_dtype(x.dtype))


@_fake("norm_affine_forward")
def _norm_affine_forward_fake(
    x: torch.Tensor,
    dim: int,
    eps: float,
    center: bool,
    out_dtype: torch.dtype,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._check(scale is not None or shift is not None, lambda: "norm_affine_forward: needs a scale or a shift")
    z, rstd = _norm_forward_fake(x, dim, eps, center, out_dtype)
    return torch.empty_like(z), z, rstd


@_fake("norm_backward")
def _norm_backward_fake(
    grad: torch.Tensor,
    z: torch.Tensor,
    rstd: torch.Tensor,
    scale: torch.Tensor | None,
    dim: int,
    center: bool,
    dtype: torch.dtype,
    column_sums: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    sums = rstd.new_empty((2, dim) if column_sums else (0,))
    return z.new_empty(z.shape, dtype=dtype), sums


@_fake("norm_exact_columns")
def _norm_exact_columns_fake(scale: torch.Tensor | None, shift: torch.Tensor | None) -> torch.Tensor:
    values = scale if scale is not None else shift
    torch._check(values is not None, lambda: "norm_exact_columns: needs a scale or a shift")
    count = torch.library.get_ctx().new_dynamic_size()  # how many depends on the values
    torch._check(count <= values.numel())
    return values.new_empty(count, dtype=torch.long)


@_fake("norm_output_forward")
def _norm_output_forward_fake(
    x: torch.Tensor,
    dim: int,
    eps: float,
    center: bool,
    out_dtype: torch.dtype,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    columns: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, _, rstd = _norm_affine_forward_fake(x, dim, eps, center, out_dtype, scale, shift)
    return y, rstd, y.new_empty((rstd.numel(), columns.numel()))


@_fake("norm_output_backward")
def _norm_output_backward_fake(
    grad: torch.Tensor,
    y: torch.Tensor,
    rstd: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    columns: torch.Tensor,
    exact: torch.Tensor,
    dim: int,
    center: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    return y.new_empty(y.shape, dtype=dtype)


@_fake("gated_exceptions")
def _gated_exceptions_fake(act: torch.Tensor, up: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch_ops.check_gated_exceptions(act, up, slots)
    rows, _ = torch_ops.rows_and_columns(act)
    return act.new_empty((rows, slots), dtype=torch.int32), up.new_empty((rows, slots))


@_fake("gated_backward")
def _gated_backward_fake(
    grad: torch.Tensor,
    gate: torch.Tensor,
    second: torch.Tensor,
    kind: str,
    act: torch.Tensor | None,
    columns: torch.Tensor | None = None,
    up_at: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    torch_ops.check_gated(grad, gate, second, kind, act, columns, up_at)
    like = torch.empty_like(grad, memory_format=torch.contiguous_format)
    return like, torch.empty_like(like)


@_fake("dropout")
def _dropout_fake(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_fake("dropout_input_and_grad")
def _dropout_input_and_grad_fake(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    dtype: torch.dtype,
    grad: torch.Tensor,
    p: float,
    seed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    read = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    return read, torch.empty_like(grad, memory_format=torch.contiguous_format)


@_fake("affine_weight_grad")
def _affine_weight_grad_fake(
    product: torch.Tensor,
    total: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    torch_ops.check_affine_weight_grad(product, total, scale, shift, dtype)
    return product.new_empty(product.shape, dtype=dtype)


@_fake("cross_entropy_grad_")
def _cross_entropy_grad_fake(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


@_fake("stock_activation")
def _stock_activation_fake(x: torch.Tensor, kind: str) -> torch.Tensor:
    return torch.empty_like(x)


OPS = getattr(torch.ops, NAMESPACE)
"""The operators' namespace: ``OPS.act_codes(x, thresholds)`` etc., the contract of :mod:`.contract`."""

_TRITON_LIBRARY: list[torch.library.Library] = []


def triton_operators(triton_ops: ModuleType) -> Any:
    """``torch.ops.lowmem_triton``: the kernel contract's functions of :mod:`.triton_ops` (the module, imported by
    the caller) as operators, defined on the first call."""
    if not _TRITON_LIBRARY:
        contract = {name: schema for name, schema in SCHEMAS.items() if hasattr(triton_ops, name)}
        _TRITON_LIBRARY.append(_define(TRITON_NAMESPACE, contract, triton_ops))
    return getattr(torch.ops, TRITON_NAMESPACE)
