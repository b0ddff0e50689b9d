"""Input validation shared by the low-memory ops: clear errors instead of wrong answers."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float_tensor(op: str, x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{op}: unsupported dtype {x.dtype}; supported: {names}")


def check_head(op: str, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> None:
    """A linear head's operands: floating ``hidden (..., features)`` and ``weight (classes, features)``, and an
    int64 class index per row of ``hidden``."""
    check_float_tensor(op, hidden)
    check_float_tensor(op, weight)
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not match")
    if target.shape != hidden.shape[:-1] or target.dtype != torch.int64:
        raise ValueError(
            f"{op}: target must be int64 of shape {tuple(hidden.shape[:-1])}, got {tuple(target.shape)} {target.dtype}"
        )


def needs_graph(x: torch.Tensor) -> bool:
    """True when autograd will record this op, i.e. when anything must be saved."""
    return torch.is_grad_enabled() and x.requires_grad


def refuse_double_backward(op: str) -> None:
    """Backward of an approximate/memory-sharing op is not itself differentiable."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op} does not support double backward (create_graph=True / higher-order gradients): "
            "its backward uses only the compact tensors saved in forward. Use the stock module "
            "for higher-order gradients."
        )
