"""Fit an activation-memory budget: after the low-memory conversion, checkpoint the fewest blocks.

The converted model's saved-for-backward bytes are measured per repeated block (transformer
layers: timm ``blocks.N``, Hugging Face ``layers.N``, BERT ``encoder.layer.N``, or the modules the
user names). Checkpointing a block (non-reentrant ``torch.utils.checkpoint``) drops what the block
saves and keeps its inputs instead; during backward the block is recomputed and holds its own
saved tensors again, one block at a time. So a plan's activation memory is::

    saved by one forward with the plan  +  the largest checkpointed block's own saved bytes

Blocks are taken by bytes freed per forward FLOP recomputed (:class:`torch.utils.flop_counter.FlopCounterMode`)
until the prediction fits; the plan is then measured on the wrapped model, and blocks are added
while the measurement does not fit. The recomputation runs the very same ops (our k-bit codes
and memory-sharing norms included) on the same RNG state, so gradients are the unbudgeted
model's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from lightning_lowmem.memory import MIB
from lightning_lowmem.surgery.convert import Surgery
from lightning_lowmem.surgery.example import CallArgs, call, isolated, tensors_in
from lightning_lowmem.surgery.measure import measure_saved


@dataclass(frozen=True)
class Block:
    """A checkpointable block, as measured on the example input."""

    name: str
    own_bytes: int  # saved for backward inside it: what checkpointing it drops, and what its recomputation holds
    input_bytes: int  # its tensor inputs: what checkpointing keeps instead
    flops: int  # of its forward: what recomputing it costs

    @property
    def freed_bytes(self) -> int:
        return self.own_bytes - self.input_bytes


@dataclass
class BudgetPlan:
    """Which blocks are checkpointed to fit ``budget_bytes``, with the prediction and the measurement.

    ``forward_bytes``: saved by one forward with the plan (measured); ``recompute_bytes``: held by the
    largest checkpointed block while it is recomputed in backward. ``recompute_fraction``: FLOPs
    recomputed per forward FLOP.
    """

    budget_bytes: int
    blocks: list[Block] = field(default_factory=list)
    checkpointed: list[str] = field(default_factory=list)
    predicted_bytes: int = 0
    forward_bytes: int = 0
    recompute_bytes: int = 0
    recompute_fraction: float = 0.0

    @property
    def measured_bytes(self) -> int:
        return self.forward_bytes + self.recompute_bytes

    def summary(self) -> str:
        names = ", ".join(self.checkpointed) if len(self.checkpointed) <= 4 else _span(self.checkpointed)
        line = f"budget {self.budget_bytes / MIB:.2f} MiB: {len(self.checkpointed)} of {len(self.blocks)} blocks checkpointed"
        if self.checkpointed:
            line += f" ({names}; {100 * self.recompute_fraction:.0f}% of the forward FLOPs recomputed)"
        return (
            f"{line}; activations predicted {self.predicted_bytes / MIB:.2f} MiB, measured "
            f"{self.forward_bytes / MIB:.2f} + {self.recompute_bytes / MIB:.2f} recomputed = {self.measured_bytes / MIB:.2f} MiB"
        )


def _span(names: list[str]) -> str:
    return f"{names[0]} ... {names[-1]}"


def checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module``'s own forward under non-reentrant activation checkpointing (module hooks ran outside it)."""
    return checkpoint(type(module).forward, module, *args, use_reentrant=False, **kwargs)


def checkpoint_block(surgery: Surgery, module: nn.Module) -> None:
    """Wrap ``module``'s forward in activation checkpointing, through ``surgery`` (so that it can be undone)."""
    surgery.override(module, "forward", partial(checkpointed_forward, module))


def find_blocks(model: nn.Module, patterns: Sequence[str] = ()) -> list[str]:
    """The modules to consider: those matching ``patterns`` (fnmatch of qualified names), else the
    children of the innermost containers of two or more same-class modules with parameters."""
    named = dict(model.named_modules())
    if patterns:
        found = [name for name in named if name and any(fnmatchcase(name, p) for p in patterns)]
        if not found:
            raise ValueError(f"apply_lowmem: checkpoint={list(patterns)} matches no module of {type(model).__name__}")
        return found
    repeated = []
    for name, module in named.items():
        children = list(module.children())
        if (
            isinstance(module, (nn.ModuleList, nn.Sequential))
            and len(children) >= 2
            and len({type(child) for child in children}) == 1
            and any(True for _ in children[0].parameters())
        ):
            repeated.append(name)
    innermost = [c for c in repeated if not any(o != c and o.startswith(f"{c}.") for o in repeated)]
    return [f"{c}.{child}" if c else child for c in innermost for child in named[c]._modules]


def measure_blocks(model: nn.Module, example: Any, names: list[str]) -> tuple[list[Block], int, int]:
    """Each block's own saved bytes, input bytes and FLOPs on ``example``; also the whole forward's
    saved bytes and FLOPs."""
    inputs: dict[str, int] = {}

    def record_inputs(name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        tensors = [t for t in tensors_in([args, kwargs]) if not isinstance(t, nn.Parameter)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        inputs.setdefault(name, sum(storages.values()))

    handles = [
        model.get_submodule(name).register_forward_pre_hook(partial(record_inputs, name), with_kwargs=True)
        for name in names
    ]
    try:
        meter = measure_saved(model, example)
        with isolated(model, train=True), FlopCounterMode(display=False) as counter:
            call(model, example)
    finally:
        for handle in handles:
            handle.remove()
    flops = {name.partition(".")[2]: sum(by_op.values()) for name, by_op in counter.get_flop_counts().items()}
    by_module = meter.by_module
    blocks = [
        Block(
            name,
            sum(n for module, n in by_module.items() if module == name or module.startswith(f"{name}.")),
            inputs.get(name, 0),
            flops.get(name, 0),
        )
        for name in names
        if name in inputs  # called in the example forward
    ]
    return blocks, meter.total_bytes, counter.get_total_flops()


def predicted_bytes(total: int, chosen: list[Block]) -> int:
    """Saved bytes with ``chosen`` checkpointed, plus the largest of them recomputed."""
    return total - sum(b.freed_bytes for b in chosen) + max((b.own_bytes for b in chosen), default=0)


def fit_budget(
    model: nn.Module, example: Any, budget_mib: float, surgery: Surgery, patterns: Sequence[str] = ()
) -> BudgetPlan:
    """Checkpoint the fewest blocks of ``model`` (through ``surgery``, so they can be undone) until the
    activation memory of a training step on ``example`` is at most ``budget_mib``.

    Raises ValueError when the budget is below what checkpointing every block achieves."""
    if not budget_mib > 0:
        raise ValueError(f"apply_lowmem: budget_mib must be a positive number of MiB, got {budget_mib!r}")
    plan = BudgetPlan(budget_bytes=round(budget_mib * MIB))
    names = find_blocks(model, patterns)
    if not names:
        raise ValueError(
            f"apply_lowmem: {type(model).__name__} has no repeated blocks to checkpoint; name them with checkpoint="
        )
    plan.blocks, total, total_flops = measure_blocks(model, example, names)
    ranked = sorted((b for b in plan.blocks if b.freed_bytes > 0), key=lambda b: -b.freed_bytes / max(b.flops, 1))
    chosen: list[Block] = []
    while predicted_bytes(total, chosen) > plan.budget_bytes and len(chosen) < len(ranked):
        chosen.append(ranked[len(chosen)])
    plan.predicted_bytes = predicted_bytes(total, chosen)
    for block in chosen:
        checkpoint_block(surgery, model.get_submodule(block.name))
    while True:  # the prediction assumed no checkpointed input is saved by anything else: measure
        plan.forward_bytes = measure_saved(model, example).total_bytes
        plan.recompute_bytes = max((b.own_bytes for b in chosen), default=0)
        if plan.measured_bytes <= plan.budget_bytes or len(chosen) == len(ranked):
            break
        chosen.append(ranked[len(chosen)])
        checkpoint_block(surgery, model.get_submodule(chosen[-1].name))
    if plan.measured_bytes > plan.budget_bytes:
        raise ValueError(
            f"apply_lowmem: an activation budget of {budget_mib:g} MiB cannot be met at this batch: checkpointing "
            f"every block ({len(chosen)}) still needs {plan.measured_bytes / MIB:.2f} MiB, the smallest achievable; "
            "use a smaller batch, or a budget of at least that"
        )
    plan.checkpointed = [b.name for b in chosen]
    plan.recompute_fraction = sum(b.flops for b in chosen) / max(total_flops, 1)
    return plan


# -- what fits a memory budget: the whole training step as a function of the sequence length ---------------------
GIB = float(1 << 30)
# Optimizer state per trainable parameter, bytes: AdamW's two moments in fp32 (torch keeps them in the parameter's
# dtype: pass 4 for bf16 parameters), bitsandbytes' 8-bit (and paged 8-bit) AdamW one byte each
OPTIMIZER_STATE_BYTES = {
    "adamw": 8, "adam": 8, "paged_adamw": 8, "paged_adamw_32bit": 8, "adamw8bit": 2, "adamw_8bit": 2,
    "paged_adamw8bit": 2, "paged_adamw_8bit": 2, "sgd": 0,
}  # fmt: skip


@dataclass(frozen=True)
class TrainingMemory:
    """What one training step holds, in bytes, at a sequence length ``T``::

        weights + gradients + optimizer + weight_copies + constant + linear * T + quadratic * T**2

    ``weights``: parameters and buffers (bitsandbytes' 4-bit weights with their quantization state);
    ``gradients``: one per trainable parameter, in its dtype; ``optimizer``: its state; ``weight_copies``:
    autocast's half-precision copies of weights saved for backward (they do not grow with ``T``); the rest is
    what one training forward saves for backward: ``quadratic`` from tensors with two dimensions of the
    sequence length (eager attention's scores), ``constant`` and ``linear`` from the others, fitted on two
    measured lengths. Workspace, the allocator's fragmentation and a GPU's context are not counted."""

    weights: int
    gradients: int
    optimizer: int
    weight_copies: int = 0
    constant: float = 0.0
    linear: float = 0.0
    quadratic: float = 0.0

    @property
    def static_bytes(self) -> float:
        """What does not grow with the sequence length."""
        return self.weights + self.gradients + self.optimizer + self.weight_copies + self.constant

    def activation_bytes(self, length: float) -> float:
        """Saved for backward at ``length`` tokens, autocast's weight copies apart."""
        return self.constant + self.linear * length + self.quadratic * length**2

    def bytes_at(self, length: float) -> float:
        """The whole step at ``length`` tokens."""
        return self.static_bytes + self.linear * length + self.quadratic * length**2

    def max_length(self, budget_bytes: float) -> int:
        """The largest whole ``T`` with ``bytes_at(T) <= budget_bytes`` (0 when not even one token fits)."""
        room = budget_bytes - self.static_bytes
        if room < self.linear + self.quadratic:
            return 0
        if self.quadratic > 0:
            length = (-self.linear + math.sqrt(self.linear**2 + 4 * self.quadratic * room)) / (2 * self.quadratic)
        elif self.linear > 0:
            length = room / self.linear
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


def fit_lengths(model: nn.Module, example: Any, lengths: Sequence[int], optimizer: str | float) -> TrainingMemory:
    """:class:`TrainingMemory` of ``model`` from what a training forward saves at two sequence lengths."""
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
    weights, gradients, state = state_bytes(model, optimizer)
    return TrainingMemory(weights, gradients, state, copies, linear_first - linear * first, linear, quadratic)
