"""Fit an activation-memory budget: after the low-memory conversion, a ladder of recomputation, taken step by step.

The converted model's saved-for-backward bytes are measured per repeated block (transformer layers: timm
``blocks.N``, Hugging Face ``layers.N``, BERT ``encoder.layer.N``, or the modules the user names) and per MLP in
them. Each rung (:data:`RUNGS`, each can be left out with ``rungs=``) frees device bytes at a cost:

- ``"tile"``: an MLP runs on tiles of the sequence, each recomputed in backward
  (:func:`~lightning_lowmem.nn.recompute.tiled_forward`): frees what it saves (its input is the norm's, kept
  anyway); costs its forward FLOPs again; its backward holds one tile.
- ``"checkpoint"``: a block recomputed in backward (:func:`~lightning_lowmem.nn.recompute.checkpointed_forward`):
  frees what it saves, keeps its inputs; costs its forward FLOPs; its recompute holds what it saved (less its
  tiled MLP's).
- ``"offload"``: a checkpointed block's input kept in host memory
  (:func:`~lightning_lowmem.nn.recompute.offloaded_forward`): frees the input's device bytes; costs moving it
  there and back over the host link. Nothing to free when the model is on the host.

Steps are taken by bytes freed per second of cost (FLOPs at :data:`DEVICE_FLOPS`, bytes at :data:`HOST_LINK`)
until the prediction fits::

    saved by one forward - freed + the largest recompute (a checkpointed block's, else one MLP tile's)

the plan is then measured on the wrapped model (with the inputs the recomputing forwards keep on the device), and
steps are added while the measurement does not fit. The recomputation runs the very same ops (k-bit codes and
memory-sharing norms included) on the same RNG state, so gradients are the unbudgeted model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_lowmem.memory import MIB
from lightning_lowmem.nn.gated import GatedMLPBase
from lightning_lowmem.nn.recompute import HOST, checkpointed_forward, offloaded_forward, tiled_forward
from lightning_lowmem.surgery.convert import Surgery
from lightning_lowmem.surgery.example import call, isolated, tensors_in
from lightning_lowmem.surgery.flops import flop_counter
from lightning_lowmem.surgery.measure import measure_saved

RUNGS = ("tile", "checkpoint", "offload")
DEVICE_FLOPS = 400e12
"""FLOP/s a recomputed forward runs at, for ranking steps and predicting their overhead: an H100's sustained bf16
matmul rate (its dense peak is 989 TFLOP/s)."""
HOST_LINK = 25e9
"""Bytes/s between device and host memory, each way, for the same: PCIe 4.0 x16 as measured (32 GB/s nominal)."""
MLP_NAMES = ("mlp", "feed_forward", "ffn")  # an MLP child of a block, by name (a fused gated MLP by its class)


@dataclass(frozen=True)
class Block:
    """A block (or an MLP), as measured on the example input."""

    name: str
    own_bytes: int  # saved for backward inside it: what recomputing it drops, and what its recomputation holds
    input_bytes: int  # its tensor inputs: what checkpointing keeps instead
    flops: int  # of its forward: what recomputing it costs
    tokens: int = 0  # the sequence length of its first input (dim -2)

    @property
    def freed_bytes(self) -> int:
        return self.own_bytes - self.input_bytes


@dataclass
class BudgetPlan:
    """The steps taken to fit ``budget_bytes``, with the prediction and the measurement.

    ``forward_bytes``: saved by one forward with the plan (measured), ``kept_bytes``: the device inputs the
    recomputing forwards keep (which saved-tensor hooks do not see), ``recompute_bytes``: held by the largest
    recompute in backward. ``recomputed_flops`` per ``forward_flops``: what the steps recompute; ``moved_bytes``:
    sent to the host and back per step; :attr:`overhead_seconds`: their predicted cost.
    """

    budget_bytes: int
    blocks: list[Block] = field(default_factory=list)
    mlps: list[Block] = field(default_factory=list)
    checkpointed: list[str] = field(default_factory=list)
    tiled: list[str] = field(default_factory=list)
    offloaded: list[str] = field(default_factory=list)
    tile_tokens: int = 0
    predicted_bytes: int = 0
    forward_bytes: int = 0
    kept_bytes: int = 0
    recompute_bytes: int = 0
    recomputed_flops: int = 0
    forward_flops: int = 0
    moved_bytes: int = 0

    @property
    def recompute_fraction(self) -> float:
        """FLOPs recomputed per forward FLOP."""
        return self.recomputed_flops / max(self.forward_flops, 1)

    @property
    def overhead_seconds(self) -> float:
        """The steps' predicted cost a step (:data:`DEVICE_FLOPS`, :data:`HOST_LINK`)."""
        return self.recomputed_flops / DEVICE_FLOPS + self.moved_bytes / HOST_LINK

    @property
    def measured_bytes(self) -> int:
        return self.forward_bytes + self.kept_bytes + self.recompute_bytes

    def summary(self) -> str:
        steps = []
        if self.tiled:
            steps.append(f"{len(self.tiled)} MLPs tiled ({self.tile_tokens} tokens a tile)")
        names = ", ".join(self.checkpointed) if len(self.checkpointed) <= 4 else _span(self.checkpointed)
        line = f"{len(self.checkpointed)} of {len(self.blocks)} blocks checkpointed"
        steps.append(line + (f" ({names})" if self.checkpointed else ""))
        if self.offloaded:
            steps.append(
                f"{len(self.offloaded)} of them offloaded ({self.moved_bytes / MIB:.2f} MiB to the host and back)"
            )
        overhead = ""
        if self.tiled or self.checkpointed:
            overhead = (
                f"; {100 * self.recompute_fraction:.0f}% of the forward FLOPs recomputed, predicted overhead "
                f"{1e3 * self.overhead_seconds:.2f} ms a step"
            )
        return (
            f"budget {self.budget_bytes / MIB:.2f} MiB: {'; '.join(steps)}{overhead}; activations predicted "
            f"{self.predicted_bytes / MIB:.2f} MiB, measured {self.forward_bytes / MIB:.2f} + "
            f"{self.kept_bytes / MIB:.2f} kept for recompute + {self.recompute_bytes / MIB:.2f} recomputed = "
            f"{self.measured_bytes / MIB:.2f} MiB"
        )


def _span(names: list[str]) -> str:
    return f"{names[0]} ... {names[-1]}"


def checkpoint_block(surgery: Surgery, module: nn.Module, offload: bool = False) -> None:
    """Wrap ``module``'s forward in activation checkpointing (its input in host memory with ``offload``), through
    ``surgery`` (so that it can be undone)."""
    surgery.override(module, "forward", partial(offloaded_forward if offload else checkpointed_forward, module))


def tile_mlp(surgery: Surgery, module: nn.Module, tokens: int) -> None:
    """Run the MLP ``module`` on tiles of ``tokens`` positions, through ``surgery``."""
    surgery.override(module, "forward", partial(tiled_forward, module, tokens))


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


def find_mlps(model: nn.Module, blocks: Sequence[str]) -> list[str]:
    """The MLP of each block, if it has one (a child named as in :data:`MLP_NAMES`, or a fused gated MLP): modules
    that act on each position alone, so that they can run on tiles of the sequence."""
    found = []
    for block in blocks:
        for name, module in model.get_submodule(block).named_children():
            if name in MLP_NAMES or isinstance(module, GatedMLPBase):
                found.append(f"{block}.{name}")
                break
    return found


def measure_blocks(model: nn.Module, example: Any, names: list[str]) -> tuple[list[Block], int, int]:
    """Each module's own saved bytes, input bytes, FLOPs and sequence length on ``example``; also the whole
    forward's saved bytes and FLOPs."""
    inputs: dict[str, tuple[int, int]] = {}

    def record_inputs(name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        storages = _input_storages(args, kwargs)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        inputs.setdefault(
            name, (sum(storages.values()), first.shape[-2] if first is not None and first.dim() >= 2 else 0)
        )

    handles = [
        model.get_submodule(name).register_forward_pre_hook(partial(record_inputs, name), with_kwargs=True)
        for name in names
    ]
    try:
        meter = measure_saved(model, example)
        with isolated(model, train=True), flop_counter() as counter:
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
            inputs[name][0],
            flops.get(name, 0),
            inputs[name][1],
        )
        for name in names
        if name in inputs  # called in the example forward
    ]
    return blocks, meter.total_bytes, counter.get_total_flops()


@dataclass
class _Ladder:
    """The steps taken so far and what they predict (see the module docstring)."""

    total: int
    blocks: dict[str, Block]
    mlps: dict[str, Block]  # by the block that holds it
    tokens: int
    on_host: bool
    tiled: set[str] = field(default_factory=set)  # block names whose MLP is tiled
    checkpointed: list[str] = field(default_factory=list)
    offloaded: set[str] = field(default_factory=set)

    def tile_fraction(self, mlp: Block) -> float:
        return min(1.0, self.tokens / max(mlp.tokens, 1))

    def own_after_tiling(self, block: str) -> int:
        """What ``block`` saves (and its recompute holds) once its MLP, if tiled, saves nothing."""
        mlp = self.mlps.get(block)
        return self.blocks[block].own_bytes - (mlp.own_bytes if block in self.tiled else 0)

    def forward(self) -> int:
        """What one forward keeps with the steps taken (the recomputing forwards' device inputs included)."""
        forward = self.total
        for block in self.tiled - set(self.checkpointed):
            forward -= self.mlps[block].own_bytes
        for block in self.checkpointed:  # keeps its input, unless offloaded, and nothing else
            forward -= self.blocks[block].own_bytes - (0 if block in self.offloaded else self.blocks[block].input_bytes)
        return forward

    def recompute(self) -> int:
        """The most a recompute holds in backward: a checkpointed block (with one tile of its tiled MLP), or one
        tile of a tiled MLP."""
        tile = {b: round(self.mlps[b].own_bytes * self.tile_fraction(self.mlps[b])) for b in self.tiled}
        return max([0, *tile.values(), *(self.own_after_tiling(b) + tile.get(b, 0) for b in self.checkpointed)])

    def predicted(self) -> int:
        return self.forward() + self.recompute()

    def steps(self, rung: str) -> list[tuple[str, float]]:
        """The steps of ``rung`` available now, as ``(block, seconds)``."""
        if rung == "tile":
            return [
                (b, m.flops / DEVICE_FLOPS)
                for b, m in self.mlps.items()
                if b not in self.tiled and m.tokens > self.tokens
            ]
        if rung == "checkpoint":
            return [(b, block.flops / DEVICE_FLOPS) for b, block in self.blocks.items() if b not in self.checkpointed]
        if self.on_host:  # offload: nothing to free where the model already is on the host
            return []
        return [(b, 2 * self.blocks[b].input_bytes / HOST_LINK) for b in self.checkpointed if b not in self.offloaded]

    def take(self, rung: str, block: str) -> None:
        if rung == "tile":
            self.tiled.add(block)
        elif rung == "checkpoint":
            self.checkpointed.append(block)
        else:
            self.offloaded.add(block)

    def undo(self, rung: str, block: str) -> None:
        if rung == "tile":
            self.tiled.discard(block)
        elif rung == "checkpoint":
            self.checkpointed.remove(block)
        else:
            self.offloaded.discard(block)

    def best(self, rungs: Sequence[str]) -> tuple[str, str] | None:
        """The next step: of the first rung (in :data:`RUNGS` order) that can still free bytes of one forward, the
        step that frees the most per second of cost (the recompute it adds is paid once, by the largest);
        ``None`` when no rung can. A tile of a checkpointed block's MLP frees nothing of the forward but what its
        recompute holds: tiling comes first."""
        now = self.forward()
        for rung in (r for r in RUNGS if r in rungs):
            best, best_rate = None, 0.0
            for block, seconds in self.steps(rung):
                self.take(rung, block)
                freed = now - self.forward()
                self.undo(rung, block)
                if freed > 0 and freed / max(seconds, 1e-12) > best_rate:
                    best, best_rate = (rung, block), freed / max(seconds, 1e-12)
            if best is not None:
                return best
        return None


def fit_budget(
    model: nn.Module,
    example: Any,
    budget_mib: float,
    surgery: Surgery,
    patterns: Sequence[str] = (),
    rungs: Sequence[str] = RUNGS,
    tile_tokens: int | None = None,
) -> BudgetPlan:
    """Take the ladder's steps on ``model`` (through ``surgery``, so they can be undone) until the activation
    memory of a training step on ``example`` is at most ``budget_mib`` (see the module docstring).

    Raises ValueError when the budget is below what every step of ``rungs`` achieves."""
    if not budget_mib > 0:
        raise ValueError(f"apply_lowmem: budget_mib must be a positive number of MiB, got {budget_mib!r}")
    plan, ladder, total_flops = _measured_ladder(model, example, round(budget_mib * MIB), patterns, rungs, tile_tokens)
    taken: list[tuple[str, str]] = []
    while ladder.predicted() > plan.budget_bytes and (step := ladder.best(rungs)) is not None:
        ladder.take(*step)
        taken.append(step)
    plan.predicted_bytes = ladder.predicted()
    applied = 0
    while True:  # the prediction assumed no recomputing input is saved by anything else: measure
        for rung, block in taken[applied:]:
            _apply(surgery, model, ladder, rung, block)
        applied = len(taken)
        plan.forward_bytes, plan.kept_bytes = _measure(model, example, ladder)
        plan.recompute_bytes = ladder.recompute()
        if plan.measured_bytes <= plan.budget_bytes or (step := ladder.best(rungs)) is None:
            break
        ladder.take(*step)
        taken.append(step)
    if plan.measured_bytes > plan.budget_bytes:
        raise ValueError(
            f"apply_lowmem: an activation budget of {budget_mib:g} MiB cannot be met at this batch: every step "
            f"({', '.join(rungs)}), checkpointing every block ({len(ladder.checkpointed)}) still needs "
            f"{plan.measured_bytes / MIB:.2f} MiB, the smallest achievable; use a smaller batch, or a budget of at "
            "least that"
        )
    return _taken(plan, ladder, total_flops)


def take_every_step(
    model: nn.Module,
    example: Any,
    surgery: Surgery,
    rungs: Sequence[str],
    patterns: Sequence[str] = (),
    tile_tokens: int | None = None,
) -> BudgetPlan:
    """Every step of ``rungs`` on ``model`` (through ``surgery``): every MLP tiled, every block checkpointed, every
    checkpointed block offloaded (on a device), as far as each rung applies: the least a step can hold."""
    plan, ladder, total_flops = _measured_ladder(model, example, 0, patterns, rungs, tile_tokens)
    for rung in (r for r in RUNGS if r in rungs):
        # every MLP, even where the example's sequence fits one tile: a longer one will not
        for block in list(ladder.mlps) if rung == "tile" else [block for block, _ in ladder.steps(rung)]:
            ladder.take(rung, block)
            _apply(surgery, model, ladder, rung, block)
    plan.predicted_bytes = ladder.predicted()
    plan.forward_bytes, plan.kept_bytes = _measure(model, example, ladder)
    plan.recompute_bytes = ladder.recompute()
    return _taken(plan, ladder, total_flops)


def _measured_ladder(
    model: nn.Module,
    example: Any,
    budget_bytes: int,
    patterns: Sequence[str],
    rungs: Sequence[str],
    tile_tokens: int | None,
) -> tuple[BudgetPlan, _Ladder, int]:
    """The blocks and MLPs of ``model`` measured on ``example``, and the ladder over them with no step taken."""
    plan = BudgetPlan(budget_bytes=budget_bytes)
    names = find_blocks(model, patterns)
    if not names:
        raise ValueError(
            f"apply_lowmem: {type(model).__name__} has no repeated blocks to checkpoint; name them with checkpoint="
        )
    mlp_names = find_mlps(model, names) if "tile" in rungs else []
    measured, total, total_flops = measure_blocks(model, example, [*names, *mlp_names])
    by_name = {b.name: b for b in measured}
    plan.blocks = [by_name[n] for n in names if n in by_name]
    plan.mlps = [by_name[n] for n in mlp_names if n in by_name]
    plan.tile_tokens = tile_tokens or max((_hidden_size(model.get_submodule(m.name)) for m in plan.mlps), default=0)
    on_host = next((p.device for p in model.parameters()), HOST).type == HOST.type
    ladder = _Ladder(
        total, {b.name: b for b in plan.blocks}, {m.name.rpartition(".")[0]: m for m in plan.mlps},
        plan.tile_tokens, on_host,
    )  # fmt: skip
    return plan, ladder, total_flops


def _taken(plan: BudgetPlan, ladder: _Ladder, total_flops: int) -> BudgetPlan:
    """``plan`` with the ladder's steps and their predicted overhead."""
    plan.checkpointed = list(ladder.checkpointed)
    plan.tiled = [ladder.mlps[b].name for b in ladder.blocks if b in ladder.tiled]
    plan.offloaded = [b for b in ladder.checkpointed if b in ladder.offloaded]
    flops = sum(ladder.blocks[b].flops for b in ladder.checkpointed)
    flops += sum(ladder.mlps[b].flops for b in ladder.tiled)  # a tile inside a recomputed block runs once more
    plan.recomputed_flops, plan.forward_flops = flops, total_flops
    plan.moved_bytes = 2 * sum(ladder.blocks[b].input_bytes for b in plan.offloaded)
    return plan


def _apply(surgery: Surgery, model: nn.Module, ladder: _Ladder, rung: str, block: str) -> None:
    if rung == "tile":
        tile_mlp(surgery, model.get_submodule(ladder.mlps[block].name), ladder.tokens)
    else:  # checkpoint, or offload: the block checkpointed again, its input on the host
        checkpoint_block(surgery, model.get_submodule(block), offload=rung == "offload")


def _measure(model: nn.Module, example: Any, ladder: _Ladder) -> tuple[int, int]:
    """What one forward with the plan saves, and the device inputs of checkpointed blocks kept for their recompute
    that nothing saves (saved-tensor hooks do not see them)."""
    kept: dict[int, int] = {}

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        kept.update(_input_storages(args, kwargs, device_only=not ladder.on_host))

    keeping = [b for b in ladder.checkpointed if b not in ladder.offloaded]
    handles = [model.get_submodule(b).register_forward_pre_hook(record, with_kwargs=True) for b in keeping]
    try:
        meter = measure_saved(model, example)
    finally:
        for handle in handles:
            handle.remove()
    counted = {ptr for _, ptr in meter.storages}
    return meter.total_bytes, sum(n for ptr, n in kept.items() if ptr not in counted)


def _input_storages(args: tuple, kwargs: dict, device_only: bool = False) -> dict[int, int]:
    """The storages of a call's tensor inputs (parameters apart; with ``device_only``, those off the host), by data
    pointer, with their bytes."""
    tensors = (t for t in tensors_in([args, kwargs]) if not isinstance(t, nn.Parameter))
    return {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if not device_only or t.device.type != HOST.type
    }


def _hidden_size(mlp: nn.Module) -> int:
    """Tokens per tile: the MLP's input features (Snowflake's ALST: tiles of about one weight matrix's values)."""
    first = next((m for m in mlp.modules() if isinstance(m, nn.Linear)), None)
    return first.in_features if first is not None else 1024
