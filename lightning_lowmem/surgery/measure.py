"""The measure stage: what one training forward saves for backward, the figure the report gives; and, where that
forward checkpoints a region (its backward recomputes it, saving again what the forward's hooks never saw), what the
whole step holds at its peak, measured."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_lowmem.memory import SavedTensorMeter
from lightning_lowmem.memory.peak import allocation_peak
from lightning_lowmem.nn.recompute import checkpointed_forward, offloaded_forward, tiled_forward
from lightning_lowmem.surgery.example import call, isolated, loss_in, tensors_in

RECOMPUTING = (checkpointed_forward, tiled_forward, offloaded_forward)  # a budget's ladder's forwards


def measure_saved(model: nn.Module, example: Any) -> SavedTensorMeter:
    """What one training-mode forward on ``example`` saves for backward (RNG and buffers restored)."""
    with isolated(model, train=True), SavedTensorMeter(model) as meter:
        call(model, example)
    return meter


def measure_step(model: nn.Module, example: Any) -> tuple[SavedTensorMeter, int | None]:
    """:func:`measure_saved`, and, where that forward checkpoints a region (:func:`checkpoints`, or a reentrant
    ``torch.utils.checkpoint`` in its graph), what the training step holds of activations at its peak
    (:func:`step_peak`); ``None`` where the forward shows it all."""
    with isolated(model, train=True), SavedTensorMeter(model) as meter:
        output = call(model, example)
    recomputes = checkpoints(model) or reentrant_checkpoint_in(output)
    del output
    return meter, (step_peak(model, example) if recomputes else None)


def checkpoints(model: nn.Module) -> bool:
    """Whether ``model``'s training forward checkpoints a region (its backward recomputes it, saving what the
    forward's saved-tensor hooks never see): Hugging Face's ``gradient_checkpointing`` on a layer, a checkpoint
    wrapper (FSDP's, Lightning's ``ModelParallelStrategy``'s), or a budget ladder's recomputing forward."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if (
            getattr(module, "gradient_checkpointing", False) is True
            or type(module).__name__ == "CheckpointWrapper"
            or (isinstance(forward, partial) and forward.func in RECOMPUTING)
        ):
            return True
    return False


def reentrant_checkpoint_in(output: Any) -> bool:
    """Whether the autograd graph behind ``output`` holds a reentrant checkpoint (``use_reentrant=True``)."""
    seen, pending = set(), [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        if node.name() == "CheckpointFunctionBackward":
            return True
        seen.add(node)
        pending.extend(next_node for next_node, _ in node.next_functions)
    return False


def step_peak(model: nn.Module, example: Any) -> int:
    """The most bytes a training step on ``example`` (forward, then backward of its loss, or of the sum of its
    outputs) holds at once above what was allocated before it (RNG and buffers restored): CUDA's peak-allocation
    counter, or on the CPU the profiler's allocation events. Gradients of trainable parameters are allocated
    beforehand (they are counted as gradients) and put back after."""
    trained = [p for p in model.parameters() if p.requires_grad]
    kept = [p.grad for p in trained]
    for p in trained:
        p.grad = torch.zeros_like(p)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def run() -> None:
        with isolated(model, train=True):
            _loss(call(model, example)).backward()

    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            run()
            return torch.cuda.max_memory_allocated(device) - start
        return allocation_peak(run)[0]
    finally:
        for p, grad in zip(trained, kept):
            p.grad = grad


def _loss(output: Any) -> torch.Tensor:
    loss = loss_in(output)
    if loss is not None:
        return loss
    return sum(t.float().sum() for t in tensors_in(output) if t.requires_grad)
