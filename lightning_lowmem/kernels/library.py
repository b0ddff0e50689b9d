"""The kernels as PyTorch operators, ``torch.ops.lowmem.*``: seen by the dispatcher and by torch.compile.

Each operator is declared once, by :func:`declare` on its reference (:mod:`.torch_ops`): a typed Python function
whose docstring is the op's meaning and whose body checks the arguments and computes the result in PyTorch. From
that one declaration come the schema (inferred from the signature), the fallback kernel (the reference itself, as
``CompositeExplicitAutograd``: it runs on a device with no compiled kernel registered), the fake kernel (the
reference run on fake tensors, or the short one a declaration gives where the reference reads values) and the
Triton operators (:func:`triton_operators`). Who computes an operator is the dispatcher's business:

- the C++ extensions register the ``CPU`` and ``CUDA`` kernels (``TORCH_LIBRARY_IMPL`` in
  ``csrc/lowmem_bind.cpp``) when :mod:`.build` loads them;
- the reference runs everywhere else;
- ``stock_activation`` is the stock ATen activation behind an opaque operator, for a backward that must recompute
  the very bits its forward computed (the gated product's): torch.compile can neither merge it with the forward's
  activation (which the partitioner would then save) nor replace it with generated code that rounds differently.

The Triton kernels are the same operators in a namespace of their own, ``torch.ops.lowmem_triton``, with the
declarations' schemas and fake kernels: the dispatcher keeps one kernel per operator and device, and both devices
have two to choose from at run time (CPU tensors: the C++ kernels, or Triton's interpreter, the GPU's side in a CPU
test; CUDA tensors: the CUDA C++ kernels, or Triton's, which a CUDA-backend head runs for its cross-entropy), so a
second kernel for a device needs a second name. torch.compile sees every Triton kernel as one graph node, never
the Python of its launcher.

These operators have no autograd formula of their own: the autograd functions of :mod:`lightning_lowmem.ops` call
them in their forward and backward. Five more, ``ms_norm``, ``affine_linear``, ``seeded_dropout``,
``step_activation`` and ``gated_activation`` (:data:`AUTOGRAD_SCHEMAS`), are those autograd functions in C++
(``csrc/lowmem_autograd.cpp``, registered for the extension's Autograd key): the ops layer calls them in eager mode
where a compiled extension serves the device, so that no Python runs per call in forward or backward, and their
dropouts draw their seeds from the device's generator in C++, as ATen's dropout does. They have no Python
reference: torch.compile, Triton and the pure-PyTorch backend use the Python functions.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

NAMESPACE = "lowmem"
TRITON_NAMESPACE = "lowmem_triton"

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

CPU_ONLY = (
    "norm_exact_columns", "norm_output_forward", "norm_output_backward", "cross_entropy_grad_", "token_log_probs",
    "token_log_probs_grad_",
)  # fmt: skip
"""The operators the CUDA extension has no kernel for: on a GPU a frozen norm saves ``z`` (its exact columns would be
counted on the host, :mod:`lightning_lowmem.ops.norm`), and a head's row ops run Triton's
(:func:`lightning_lowmem.kernels.head_implementation`)."""


class Declared:
    """One declared operator: its reference (the function :func:`declare` decorated), schema and fake kernel."""

    def __init__(self, reference: Callable, schema: str, fake: Callable) -> None:
        self.name, self.reference, self.schema, self.fake = reference.__name__, reference, schema, fake
        self.parameters = tuple(inspect.signature(reference).parameters)


DECLARED: dict[str, Declared] = {}
"""Every declared operator by name, in declaration order."""

_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in AUTOGRAD_SCHEMAS.items():
    _LIBRARY.define(_name + _schema)


def declare(fake: Callable | None = None, mutates: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Declare the decorated reference as the operator ``lowmem::<its name>`` (see the module's docstring).

    ``fake``: the fake kernel, for a reference that reads tensor values (a seed, a data-dependent size) and so cannot
    run on fake tensors; by default the reference is its own fake kernel. ``mutates``: the arguments it writes.
    Integer arguments are host integers (the kernels read them as ``int64_t``), never symbolic sizes.
    """

    def register(reference: Callable) -> Callable:
        name = reference.__name__
        schema = torch.library.infer_schema(reference, mutates_args=mutates).replace("SymInt", "int")
        _LIBRARY.define(name + schema)
        _LIBRARY.impl(name, reference, "CompositeExplicitAutograd")
        declared = Declared(reference, schema, _on_one_device(name, fake or reference))
        torch.library.register_fake(f"{NAMESPACE}::{name}", declared.fake, lib=_LIBRARY)
        DECLARED[name] = declared
        return reference

    return register


def _on_one_device(name: str, fake: Callable) -> Callable:
    """``fake``, after checking every tensor argument is on the first one's device, as the kernels check: a meta
    tensor among real ones sends the call to the fake kernel (the Meta key outranks the others), which would
    otherwise return an empty tensor as the result."""

    @functools.wraps(fake)
    def on_one_device(*args: Any) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        for tensor in tensors[1:]:
            if tensor.device != tensors[0].device:
                raise RuntimeError(
                    f"{name}: every tensor must be on {tensors[0].device} with the first, got one on {tensor.device}"
                )
        return fake(*args)

    return on_one_device


OPS = getattr(torch.ops, NAMESPACE)
"""The operators' namespace: ``OPS.act_codes(x, thresholds)`` etc., the ops of :data:`DECLARED`."""

_TRITON_LIBRARY: list[torch.library.Library] = []


def triton_operators(triton_ops: ModuleType) -> Any:
    """``torch.ops.lowmem_triton``: every declared operator again, computed by the function of its name in
    :mod:`.triton_ops` (the module, imported by the caller) where it has one and the reference where it has none or a
    float64 tensor or dtype is given (the Triton kernels compute in fp32); defined on the first call."""
    if not _TRITON_LIBRARY:
        library = torch.library.Library(TRITON_NAMESPACE, "DEF")
        for name, declared in DECLARED.items():
            library.define(name + declared.schema)
            kernel = getattr(triton_ops, name, None)
            library.impl(
                name,
                declared.reference if kernel is None else _fp64_by_reference(kernel, declared),
                "CompositeExplicitAutograd",
            )
            torch.library.register_fake(f"{TRITON_NAMESPACE}::{name}", declared.fake, lib=library)
        _TRITON_LIBRARY.append(library)
    return getattr(torch.ops, TRITON_NAMESPACE)


def _fp64_by_reference(kernel: Callable, declared: Declared) -> Callable:
    """``kernel``, except that a call with a float64 tensor or dtype among its arguments runs the reference."""
    if list(inspect.signature(kernel).parameters) != list(declared.parameters):
        raise TypeError(f"{kernel.__qualname__} must take the arguments of its declaration, {declared.parameters}")

    @functools.wraps(kernel)
    def by_dtype(*args: Any) -> Any:
        fp64 = any(a is torch.float64 or (isinstance(a, torch.Tensor) and a.dtype == torch.float64) for a in args)
        return (declared.reference if fp64 else kernel)(*args)

    return by_dtype
