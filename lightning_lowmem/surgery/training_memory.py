"""What a training step holds as a function of the sequence length: weights (4-bit quantization state included),
gradients, optimizer state, the activations a forward saves, and what the backward holds beyond them (recomputed
blocks and tiles, the inputs checkpoints keep, gradient buffers: the step's measured peak less the saved
activations), each measured at two lengths (linear, plus a quadratic term from tensors with two dimensions of the
length: eager attention's scores). Behind :func:`~lightning_lowmem.training_memory` and
:func:`~lightning_lowmem.max_sequence_length`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_lowmem.memory import MIB
from lightning_lowmem.surgery.example import CallArgs, tensors_in
from lightning_lowmem.surgery.measure import measure_saved, step_peak

GIB = float(1 << 30)
# Optimizer state per trainable parameter, bytes: AdamW's two moments in fp32 (torch keeps them in the parameter's
# dtype: pass 4 for bf16 parameters), bitsandbytes' 8-bit (and paged 8-bit) AdamW one byte each
OPTIMIZER_STATE_BYTES = {
    "adamw": 8, "adam": 8, "paged_adamw": 8, "paged_adamw_32bit": 8, "adamw8bit": 2, "adamw_8bit": 2,
    "paged_adamw8bit": 2, "paged_adamw_8bit": 2, "sgd": 0,
}  # fmt: skip


@dataclass(frozen=True)
class TrainingMemory:
    """What one training step holds at its peak, in bytes, at a sequence length ``T``::

        weights + gradients + optimizer + weight_copies + constant + linear * T + quadratic * T**2
            + transient + transient_linear * T + transient_quadratic * T**2

    ``weights``: parameters and buffers (bitsandbytes' 4-bit weights with their quantization state);
    ``gradients``: one per trainable parameter, in its dtype; ``optimizer``: its state; ``weight_copies``:
    autocast's half-precision copies of weights saved for backward (they do not grow with ``T``); the rest is
    what one training forward saves for backward: ``quadratic`` from tensors with two dimensions of the
    sequence length (eager attention's scores), ``constant`` and ``linear`` from the others, fitted on two
    measured lengths; ``transient*``: what the backward holds beyond those at the step's peak (a step's allocation
    peak, measured, less the saved activations; a third length where attention is eager, whose backward holds
    scores' gradients; 0 when not measured). The optimizer's
    step, the allocator's fragmentation and a GPU's context and kernels' workspace are not counted."""

    weights: int
    gradients: int
    optimizer: int
    weight_copies: int = 0
    constant: float = 0.0
    linear: float = 0.0
    quadratic: float = 0.0
    transient: float = 0.0
    transient_linear: float = 0.0
    transient_quadratic: float = 0.0

    @property
    def static_bytes(self) -> float:
        """What does not grow with the sequence length."""
        return self.weights + self.gradients + self.optimizer + self.weight_copies + self.constant + self.transient

    @property
    def per_token(self) -> float:
        """What the step's peak grows by per token (the quadratic term apart)."""
        return self.linear + self.transient_linear

    @property
    def per_token_pair(self) -> float:
        """What the step's peak grows by per square token (eager attention's scores and their gradients)."""
        return self.quadratic + self.transient_quadratic

    def activation_bytes(self, length: float) -> float:
        """Saved for backward at ``length`` tokens, autocast's weight copies apart."""
        return self.constant + self.linear * length + self.quadratic * length**2

    def bytes_at(self, length: float) -> float:
        """The whole step at ``length`` tokens, at its peak."""
        return self.static_bytes + self.per_token * length + self.per_token_pair * length**2

    def max_length(self, budget_bytes: float) -> int:
        """The largest whole ``T`` with ``bytes_at(T) <= budget_bytes`` (0 when not even one token fits)."""
        room, square = budget_bytes - self.static_bytes, self.per_token_pair
        if room < self.per_token + square:
            return 0
        if square > 0:
            length = (-self.per_token + math.sqrt(self.per_token**2 + 4 * square * room)) / (2 * square)
        elif self.per_token > 0:
            length = room / self.per_token
        else:
            raise ValueError("max_sequence_length: the saved bytes do not grow with the sequence length")
        length = math.floor(length)
        while length > 0 and self.bytes_at(length) > budget_bytes:  # the square root's rounding
            length -= 1
        return length

    def summary(self, length: int | None = None) -> str:
        line = (
            f"weights {self.weights / GIB:.2f} GiB, gradients {self.gradients / GIB:.2f} GiB, optimizer "
            f"{self.optimizer / GIB:.2f} GiB, weight copies {self.weight_copies / GIB:.2f} GiB, activations "
            f"{self.constant / MIB:.2f} MiB + {self.linear / MIB:.4f} MiB/token"
        )
        if self.transient or self.transient_linear:
            line += (
                f", backward beyond them {self.transient / MIB:.2f} MiB + {self.transient_linear / MIB:.4f} MiB/token"
            )
        if self.quadratic:
            line += f" + {self.quadratic:.1f} B/token^2"
        if length is not None:
            line += f"; {length} tokens: {self.bytes_at(length) / GIB:.3f} GiB"
        return line


def state_bytes(model: nn.Module, optimizer: str | float = "adamw") -> tuple[int, int, int]:
    """Weights (parameters and buffers, each storage once, with bitsandbytes' quantization state), gradients (one
    per trainable parameter, in its dtype) and optimizer state (``optimizer``: a name of
    :data:`OPTIMIZER_STATE_BYTES`, or bytes per trainable parameter) of ``model``, in bytes."""
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZER_STATE_BYTES:
            raise ValueError(
                f"max_sequence_length: unknown optimizer {optimizer!r}; name one of "
                f"{', '.join(OPTIMIZER_STATE_BYTES)} or give its state's bytes per trainable parameter"
            )
        per_parameter = OPTIMIZER_STATE_BYTES[optimizer.lower()]
    elif isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool) and optimizer >= 0:
        per_parameter = optimizer
    else:
        raise ValueError(
            f"max_sequence_length: optimizer must be a name or bytes per trainable parameter, got {optimizer!r}"
        )
    storages: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers(), *_quantization_state(model)):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    trained = [p for p in model.parameters() if p.requires_grad]
    gradients = sum(p.numel() * p.element_size() for p in trained)
    return sum(storages.values()), gradients, round(per_parameter * sum(p.numel() for p in trained))


def _quantization_state(model: nn.Module) -> Iterator[torch.Tensor]:
    """bitsandbytes' block scales and code books, held beside a quantized weight rather than as parameters."""
    for parameter in model.parameters():
        state = getattr(parameter, "quant_state", None)
        while state is not None:
            for name in ("absmax", "code", "offset"):
                value = getattr(state, name, None)
                if isinstance(value, torch.Tensor):
                    yield value
            state = getattr(state, "state2", None)


def sequence_length(example: Any, owner: str) -> int:
    """The sequence length of ``example``: dim 1 of its tensors of two or more dims, which must agree."""
    lengths = {t.shape[1] for t in tensors_in(_call_parts(example)) if t.dim() >= 2}
    if len(lengths) != 1:
        raise ValueError(
            f"{owner}: the example's tensors of two or more dims must share their sequence length (dim 1), got "
            f"{sorted(lengths) or 'no such tensor'}"
        )
    return lengths.pop()


def with_length(example: Any, length: int) -> Any:
    """``example`` with its tensors' dim 1 (the sequence) cut or repeated to ``length`` tokens; 1-D tensors (per
    row) and other values as they are."""

    def resize(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            return value
        index = torch.arange(length, device=value.device) % value.shape[1]
        return value.index_select(1, index)

    if isinstance(example, CallArgs):
        return CallArgs(tree_map(resize, example.args), tree_map(resize, example.kwargs), example.module)
    return tree_map(resize, example)


def _call_parts(example: Any) -> Any:
    return [example.args, example.kwargs] if isinstance(example, CallArgs) else example


def fit_lengths(
    model: nn.Module, example: Any, lengths: Sequence[int], optimizer: str | float, peak: bool = True
) -> TrainingMemory:
    """:class:`TrainingMemory` of ``model`` from what a training forward saves at two sequence lengths (with
    ``peak``, also what a whole step holds at its peak: at a third length too where the saved bytes have a
    quadratic term)."""
    first, second = lengths
    fits = []
    copies = 0
    for length in (first, second):
        meter = measure_saved(model, with_length(example, length))
        quadratic = sum(r.nbytes for r in meter.records if not r.weight_copy and list(r.shape).count(length) >= 2)
        fits.append((meter.activation_bytes - quadratic, quadratic))
        copies = max(copies, meter.weight_copy_bytes)
    quadratic = fits[1][1] / second**2  # the second length: the first may equal a model dimension
    linear_first = fits[0][0] + fits[0][1] - quadratic * first**2  # what the quadratic term leaves
    linear = (fits[1][0] - linear_first) / (second - first)
    saved = lambda length: linear_first + linear * (length - first) + quadratic * length**2
    weights, gradients, state = state_bytes(model, optimizer)
    memory = TrainingMemory(weights, gradients, state, copies, linear_first - linear * first, linear, quadratic)
    if not peak:
        return memory
    points = (first, second, 4 * second) if quadratic else (first, second)
    beyond = [step_peak(model, with_length(example, length)) - saved(length) - copies for length in points]
    return replace(
        memory, **dict(zip(("transient", "transient_linear", "transient_quadratic"), polynomial(points, beyond)))
    )


def polynomial(xs: Sequence[int], ys: Sequence[float]) -> tuple[float, ...]:
    """The coefficients (constant first) of the polynomial of degree ``len(xs) - 1`` through the points."""
    solution = torch.linalg.solve(
        torch.tensor([[float(x) ** k for k in range(len(xs))] for x in xs], dtype=torch.float64, device="cpu"),
        torch.tensor(ys, dtype=torch.float64, device="cpu"),
    )
    return tuple(solution.tolist())
