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

from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import partial
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from lightning_lowmem.memory import MIB
from lightning_lowmem.surgery.convert import Surgery
from lightning_lowmem.surgery.example import call, isolated, tensors_in
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
