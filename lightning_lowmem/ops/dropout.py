"""Dropout that saves nothing but its seed: the backward regenerates the mask from it.

Stock dropout keeps its mask for backward (a bool per element on CUDA, an fp32 noise tensor on CPU). Here the
forward draws a seed from the device's default generator, the kernels draw the mask from it with a
counter-based generator (Philox, :func:`~lightning_lowmem.kernels.torch_ops.dropout`), and the
backward applies the same mask to the gradient from the seed alone. Where a compiled extension serves the device
the seed is drawn in C++ (``lowmem::seeded_dropout``, ``lowmem::affine_linear``): a key from the CPU's generator,
kept as two integers, or a GPU's key and counters from its Philox state, as ATen's dropout takes them (no operator
of its own), written by the kernel into a two-value tensor on the GPU (no host read; CUDA-graph safe). Because the seed comes from torch's
generator, ``torch.manual_seed``, Lightning's per-rank seeding and activation checkpointing (which replays the
generator's state before its recompute) govern the masks as they govern stock dropout's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lightning_lowmem import kernels
from lightning_lowmem.kernels import library
from lightning_lowmem.ops._checks import check_float_tensor, needs_graph, refuse_double_backward

SEED_RANGE = 2**62
_suspended = 0


@contextmanager
def dropout_suspended() -> Iterator[None]:
    """Every dropout of this library the identity (its evaluation behaviour) for the duration, and no seed drawn: the
    verify stage compares a training step with the stock model's, whose dropouts it turns off as well."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


def dropping(training: bool) -> bool:
    """Whether a dropout in a module whose training flag is ``training`` drops (not under :func:`dropout_suspended`)."""
    return training and not _suspended


def draw_seed(device: torch.device) -> torch.Tensor:
    """A seed (one int64 on ``device``) from the device's default generator: no host synchronisation on a GPU. (The
    C++ autograd functions draw theirs in C++, with no operator of its own: :func:`dropout_and_seed`.)"""
    return torch.randint(SEED_RANGE, (1,), device=device)


class SeededDropoutFunction(torch.autograd.Function):
    """``x * mask / (1 - p)`` saving only the seed of ``mask``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(seed)
        ctx.p = p
        return kernels.implementation(x.device).dropout(x, p, seed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_double_backward("seeded_dropout")
        (seed,) = ctx.saved_tensors
        return kernels.implementation(grad.device).dropout(grad, ctx.p, seed), None, None


def check_probability(op: str, p: object) -> float:
    """``p`` as a float in [0, 1], else the error ``F.dropout`` gives."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{op}: dropout probability has to be between 0 and 1, but got {p!r}")
    return float(p)


def dropout_and_seed(x: torch.Tensor, p: float, seed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A training dropout of ``x`` (``0 < p < 1``) and the seed of its mask: ``seed``, else one drawn from the device's
    generator (in C++ by ``lowmem::seeded_dropout`` where a compiled extension serves the device, else
    :func:`draw_seed`)."""
    if seed is None and kernels.autograd_in_cpp(x):
        y, seed = library.OPS.seeded_dropout.default(x, p)
        return y, seed
    seed = draw_seed(x.device) if seed is None else seed
    if needs_graph(x):
        return SeededDropoutFunction.apply(x, p, seed), seed
    return kernels.implementation(x.device).dropout(x, p, seed), seed


def seeded_dropout(
    x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, seed: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.dropout(x, p, training, inplace)`` that saves only a seed for backward: Bernoulli(1 - p) masks scaled by
    ``1 / (1 - p)``; ``x`` itself in evaluation or at ``p = 0``, zeros at ``p = 1``, as stock. ``seed``: the one
    to draw the mask from (default: a fresh one from the device's generator, :func:`dropout_and_seed`)."""
    check_float_tensor("seeded_dropout", x)
    p = check_probability("seeded_dropout", p)
    if not dropping(training) or p == 0.0:
        return x
    if p == 1.0:
        return x.mul_(0.0) if inplace else x * 0.0
    y, _ = dropout_and_seed(x, p, seed)
    return x.copy_(y) if inplace else y
