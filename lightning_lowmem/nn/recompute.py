"""Forwards that keep less for backward by recomputing in backward, installed on a module instance by the budget
(:mod:`lightning_lowmem.surgery.budget`), each the module's own forward (its hooks run outside) under non-reentrant
activation checkpointing (same ops, same RNG state: the gradients are the plain forward's):

- :func:`checkpointed_forward`: the whole module; it keeps its inputs and, in backward, holds its own saved
  tensors again while it is recomputed.
- :func:`tiled_forward`: a module that works token by token (an MLP), run on tiles of the sequence, each
  checkpointed: it keeps only its input (a memory-sharing norm's output, which that norm keeps anyway), and its
  backward holds one tile's intermediates, not the whole sequence's (Snowflake's ALST "TiledMLP").
- :func:`offloaded_forward`: as :func:`checkpointed_forward`, its first input (the hidden states) kept in host
  memory (pinned, copied without blocking) and brought back for the recompute: the device keeps nothing of it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_lowmem.nn.norm import Sharing, sharing_of, tagged

HOST = torch.device("cpu")


def checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module``'s own forward under non-reentrant activation checkpointing (module hooks ran outside it)."""
    return checkpoint(type(module).forward, module, *args, use_reentrant=False, **kwargs)


def tiled_forward(module: nn.Module, tokens: int, x: torch.Tensor) -> torch.Tensor:
    """``module``'s own forward on tiles of ``tokens`` positions of ``x``'s sequence dimension (-2), each
    checkpointed; the plain forward where nothing is recorded for backward or the sequence fits one tile. The
    module must act on each position alone (an MLP: no attention, no sequence-wide norm)."""
    forward = type(module).forward
    if not torch.is_grad_enabled() or x.dim() < 2 or x.shape[-2] <= tokens:
        return forward(module, x)

    def run(tile: torch.Tensor, sharing: Sharing | None) -> torch.Tensor:
        # the recompute's tile is a detached copy: tagged as the forward's, its readers save the norm's z again
        return forward(module, tagged(tile, sharing))

    tiles = x.split(tokens, dim=-2)
    return torch.cat([checkpoint(run, tile, sharing_of(tile), use_reentrant=False) for tile in tiles], dim=-2)


def offloaded_forward(module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``module``'s own forward, checkpointed, its input ``x`` kept in host memory between the forward and the
    recompute (a copy: ``x`` itself is kept by nothing, so the device frees it once the caller does)."""
    device = x.device
    held = torch.empty(x.shape, dtype=x.dtype, device=HOST, pin_memory=x.is_cuda)
    held.copy_(x, non_blocking=x.is_cuda)  # differentiable: the gradient flows back to x
    # checkpoint stashes the RNG state of the devices of its tensor arguments: without one on x's device the
    # recompute would draw other dropout masks there
    on_device = torch.empty(0, device=device)

    def run(held: torch.Tensor, on_device: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return type(module).forward(module, held.to(on_device.device, non_blocking=True), *args, **kwargs)

    return checkpoint(run, held, on_device, *args, use_reentrant=False, **kwargs)
