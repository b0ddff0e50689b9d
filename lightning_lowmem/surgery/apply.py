"""``apply_lowmem``: verified, all-or-nothing model surgery, one stage per module.

Activations (GELU erf/tanh, SiLU, QuickGELU, Mish) become k-bit step-derivative activations
wherever they are modules, except inside gated MLPs (LLaMA-family, timm SwiGLU / GluMlp), which
become one fused, exact, low-memory ``act(gate) * up`` (:mod:`lightning_lowmem.nn.gated`),
verified against the stock MLP. A LayerNorm / RMSNorm becomes a memory-sharing norm only where a
probe forward proves its output reaches nothing but linear layers; its affine moves into those
linears (:class:`~lightning_lowmem.nn.LowMemLinear`) without renaming any parameter, so checkpoints
stay interchangeable with the stock model. Every other ``nn.Linear`` recasts its weight in backward
instead of saving a half-precision copy under autocast.

Dropouts save a seed instead of their mask (a LoRA adapter's folds into its first product), LitGPT's
and hand-written LoRA layers share their input norm's tensor through their adapter, LitGPT's attention
lays its inputs out to save less, and a Hugging Face causal LM's training loss runs through the fused
linear + cross-entropy, which never holds the logits.

The stages (:func:`run`): nominate (each family of :mod:`.families` finds and verifies its candidates)
-> :mod:`.probe` (which layers read each norm's output) -> plan (each family's changes; nothing changed
yet) -> apply the changes (:mod:`.convert`) -> :mod:`.verify` (eval outputs, and a training step's loss and
gradients, as stock's; a kind that can be undone alone and fails is) -> :mod:`.measure`
(saved bytes before and after) -> :mod:`.budget` (checkpoint the fewest blocks); any exception after
the plan rolls everything back. Without an example input it runs at the model's first training forward
(:mod:`.deferred`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch._dynamo import OptimizedModule

from lightning_lowmem.memory import MIB
from lightning_lowmem.nn.adapters.bitsandbytes import keep_4bit_layers_trainable
from lightning_lowmem.surgery import fsdp
from lightning_lowmem.surgery.budget import fit_budget, take_every_step
from lightning_lowmem.surgery.changes import Plan
from lightning_lowmem.surgery.convert import Surgery
from lightning_lowmem.surgery.deferred import convert_at_first_forward
from lightning_lowmem.surgery.example import batch_size, describe, gpus_of, with_batch_size
from lightning_lowmem.surgery.families import FAMILIES, Candidates
from lightning_lowmem.surgery.identify import names_activation
from lightning_lowmem.surgery.measure import measure_saved, measure_step, step_peak
from lightning_lowmem.surgery.options import Options, takes_options
from lightning_lowmem.surgery.probe import Flow, probe
from lightning_lowmem.surgery.report import LowMemReport
from lightning_lowmem.surgery.training_memory import (
    GIB,
    TrainingMemory,
    fit_lengths,
    sequence_length,
    with_length,
)
from lightning_lowmem.surgery.verify import (
    check_approximation,
    check_training,
    eval_outputs,
    training_batch,
    training_step,
    verify,
)
from lightning_lowmem.surgery.zero3 import whole


@takes_options
def apply_lowmem(model: nn.Module, example_input: Any = None, **options: Any) -> LowMemReport:
    """Convert ``model`` in place for low-memory backpropagation and report what changed.

    Args:
        model: any ``nn.Module`` (timm, Hugging Face, peft, custom; a ``torch.compile``'d module is
            converted through the module it compiles: convert before its first call). Parameters
            stay the same objects, so optimizers and DDP keep working; run it before FSDP (FSDP1) wraps
            the model; a model FSDP2's ``fully_shard`` sharded converts as it is.
        example_input: an input as Lightning's ``example_input_array`` (tensor, tuple of
            positional args, or dict of keyword args) for the probe that decides the norms, the
            check of the outputs, the memory measurement and the budget; without it they run on
            the first training forward's input (see below).
        {options}

    Without ``example_input`` (and with ``norm`` on or a budget) the conversion waits for the
    model's first forward with gradients enabled, runs on that forward's own input (probe,
    convert, verify: all or nothing) and lets that forward go on through the converted model;
    the report fills in then (``report.pending`` until then). If the model cannot run that
    input, nothing changes and the model's own error surfaces; the next training forward tries
    again.

    Returns:
        The :class:`LowMemReport`. Running it again on a converted model changes nothing.
    """
    if isinstance(model, OptimizedModule):  # torch.compile'd: convert the module it compiles
        if example_input is None:
            raise ValueError(
                "apply_lowmem: a torch.compile'd model is converted on an example input: pass example_input, "
                "or call apply_lowmem before torch.compile"
            )
        model = model._orig_mod
    parsed = Options.parse(options).check_patterns(model)
    if example_input is None and parsed.needs_input:
        report = convert_at_first_forward(model, lambda call: run(report, model, parsed, call))
        return report
    report = LowMemReport(notes=keep_4bit_layers_trainable(model))
    run(report, model, parsed, example_input)
    return report


@takes_options
def plan(model: nn.Module, example_input: Any, **options: Any) -> LowMemReport:
    """What :func:`apply_lowmem` would do to ``model`` on ``example_input`` (with ``budget_mib``: which
    blocks it would checkpoint), without changing it: the surgery runs, is measured, and is undone.

    Args:
        model: the model, as for :func:`apply_lowmem`.
        example_input: the input to plan on.
        {options}
    """
    if example_input is None:
        raise ValueError("plan: an example input is needed to plan on")
    parsed = Options.parse(options, "plan").check_patterns(model)
    report = LowMemReport()
    run(report, model, Options(**{**parsed.as_dict(), "verify": True, "measure": True}), example_input).rollback()
    return report


@takes_options
def max_batch_size(
    model: nn.Module, example_input: Any, budget_mib: float, ladder: Sequence[str] = (), **options: Any
) -> int:
    """The largest batch whose activation memory after :func:`apply_lowmem` fits ``budget_mib``, ``model`` left
    unchanged: without ``ladder``, what one forward saves; with it, what every step of those rungs leaves (saved,
    kept for the recomputes and held by the largest recompute), i.e. the largest batch at which
    ``apply_lowmem(budget_mib=..., rungs=ladder)`` meets the budget.

    Activations grow linearly with the batch (dim 0 of every tensor of ``example_input``) and
    autocast's weight copies do not: the estimate extrapolates one measurement on the example,
    then measures the converted model at that size and moves by one until it is the largest that fits.

    Args:
        model: the model, as for :func:`apply_lowmem`.
        example_input: an input whose tensors share their batch size (dim 0).
        budget_mib: the activation memory to fit, in MiB.
        ladder: rungs of the budget's ladder (``"tile"``, ``"checkpoint"``, ``"offload"``) whose every step is
            taken at each size measured; ``()``: none.
        {options}
    """
    owner = "max_batch_size"
    budget_bytes = round(budget_mib * MIB)
    ladder = Options(rungs=ladder).rungs  # validated
    with while_converted(model, example_input, options, owner, lowmem=True) as parsed:

        def fits(size: int) -> bool:
            return _activation_bytes(model, with_batch_size(example_input, size), parsed, ladder)[0] <= budget_bytes

        measured, fixed = _activation_bytes(model, example_input, parsed, ladder)
        per_row = max((measured - fixed) / batch_size(example_input, owner), 1.0)
        size = int((budget_bytes - fixed) // per_row)
        if size >= 1 and fits(size):  # up while the next fits, or down to the first that fits: each size once
            while fits(size + 1):
                size += 1
        else:
            size -= 1
            while size >= 1 and not fits(size):
                size -= 1
    if size < 1:
        raise ValueError(f"{owner}: not even one example fits {budget_mib:g} MiB of activations")
    return size


def _activation_bytes(model: nn.Module, example: Any, options: Options, ladder: Sequence[str]) -> tuple[int, int]:
    """What a training step on ``example`` holds of activations, and the part that does not grow with the batch
    (autocast's weight copies; none counted under a ladder): one forward's saved bytes, or with ``ladder`` the
    budget's measurement with every step of those rungs taken (then undone)."""
    if not ladder:
        meter = measure_saved(model, example)
        return meter.total_bytes, meter.weight_copy_bytes
    surgery = Surgery(model)
    try:
        steps = take_every_step(model, example, surgery, ladder, options.checkpoint, options.tile_tokens)
    finally:
        surgery.rollback()
    return steps.measured_bytes, 0


@contextmanager
def while_converted(
    model: nn.Module, example: Any, options: dict[str, Any], owner: str, lowmem: bool, ladder: Sequence[str] = ()
) -> Iterator[Options]:
    """``model`` converted quietly (no check, no measurement) for the duration, unless not ``lowmem``, and every
    step of the ``ladder``'s rungs taken; yields the parsed options."""
    parsed = Options.parse(options, owner).check_patterns(model)
    ladder = Options(rungs=ladder).rungs  # validated
    quiet = Options(**{**parsed.as_dict(), "verify": False, "measure": False})
    surgery = run(LowMemReport(), model, quiet, example) if lowmem else Surgery(model)
    try:
        if ladder:
            take_every_step(model, example, surgery, ladder, parsed.checkpoint, parsed.tile_tokens)
        yield parsed
    finally:
        surgery.rollback()


@takes_options
def training_memory(
    model: nn.Module,
    example_input: Any,
    optimizer: str | float = "adamw",
    lowmem: bool = True,
    ladder: Sequence[str] = (),
    **options: Any,
) -> TrainingMemory:
    """What a training step of ``model`` holds as a function of the sequence length (a :class:`TrainingMemory`),
    after :func:`apply_lowmem` (``lowmem=False``: the stock model), ``model`` left unchanged.

    Weights, gradients and optimizer state are counted from the parameters; the activations a forward saves and
    the step's peak beyond them (the backward's gradients, recomputed blocks and tiles) are measured at the
    example's length ``T`` and at ``2 T + 1``: linear in the length, plus a quadratic term from tensors with two
    dimensions of the length (eager attention's scores; SDPA and flash attention have none).

    Args:
        model: the model, as for :func:`apply_lowmem`.
        example_input: an input whose tensors of two or more dims share their sequence length (dim 1), e.g. a
            dict of ``input_ids``, ``attention_mask`` and ``labels`` (with ``labels`` the loss counts).
        optimizer: its state's bytes per trainable parameter, or a name: ``"adamw"`` (two fp32 moments, 8 B),
            ``"adamw8bit"`` / ``"paged_adamw_8bit"`` (bitsandbytes, 2 B), ``"paged_adamw_32bit"`` (8 B), ``"sgd"``.
        lowmem: measure the converted model (else the stock model: the options are not used).
        ladder: rungs of the budget's ladder (``"tile"``, ``"checkpoint"``, ``"offload"``) whose every step is
            taken before measuring: every MLP tiled, every block checkpointed, every block's input offloaded
            (where the model is on a device), the stock model's too; ``()``: none.
        {options}
    """
    length = sequence_length(example_input, "training_memory")
    with while_converted(model, example_input, options, "training_memory", lowmem, ladder):
        return fit_lengths(model, example_input, (length, 2 * length + 1), optimizer)


@takes_options
def max_sequence_length(
    model: nn.Module,
    example_input: Any,
    budget_gib: float,
    optimizer: str | float = "adamw",
    lowmem: bool = True,
    ladder: Sequence[str] = (),
    **options: Any,
) -> int:
    """The longest sequence whose training step fits ``budget_gib``: weights, gradients, optimizer state and the
    step's peak of activations after :func:`apply_lowmem` (``lowmem=False``: the stock model's; with ``ladder``,
    every step of those rungs taken), ``model`` left unchanged.

    The prediction is :func:`training_memory`'s (the saved activations and the backward's peak beyond them, each
    measured at two lengths: linear, plus a quadratic term where attention is eager); the model's step is then
    measured at the predicted length, and the length lowered until the measurement fits. The optimizer's step, a
    GPU's context, kernels' workspace and the allocator's fragmentation are not counted: leave room for them.

    Args:
        model: the model, as for :func:`apply_lowmem`.
        example_input: an input whose tensors of two or more dims share their sequence length (dim 1); its
            batch size is kept.
        budget_gib: the memory to fit, in GiB (2**30 bytes).
        optimizer: as for :func:`training_memory`.
        lowmem: as for :func:`training_memory`.
        ladder: as for :func:`training_memory`.
        {options}

    Returns:
        The length in tokens. Raises ValueError when not even one token fits.
    """
    owner = "max_sequence_length"
    if isinstance(budget_gib, bool) or not isinstance(budget_gib, (int, float)) or not budget_gib > 0:
        raise ValueError(f"{owner}: budget_gib must be a positive number of GiB, got {budget_gib!r}")
    budget_bytes = budget_gib * GIB
    length = sequence_length(example_input, owner)
    with while_converted(model, example_input, options, owner, lowmem, ladder):
        memory = fit_lengths(model, example_input, (length, 2 * length + 1), optimizer)
        size = memory.max_length(budget_bytes)
        state = memory.weights + memory.gradients + memory.optimizer
        while size >= 1:  # measured at the predicted length: lowered until the measurement fits
            excess = state + step_peak(model, with_length(example_input, size)) - budget_bytes
            if excess <= 0:
                break
            size -= max(1, math.ceil(excess / max(memory.per_token + 2 * memory.quadratic * size, 1.0)))
    if size < 1:
        raise ValueError(
            f"{owner}: not even one token fits {budget_gib:g} GiB: {memory.summary()}; weights, gradients and "
            f"optimizer state alone take {state / GIB:.2f} GiB"
        )
    return size


def nominate(model: nn.Module, options: Options, example: Any = None) -> Candidates:
    """Every family's verified candidates, in the order of :data:`FAMILIES`; modules an earlier run converted are
    reported so. Nothing changes."""
    found = Candidates(fsdp_owners=fsdp.owners(model), example=example)
    for name, module in model.named_modules():
        family = next((f for f in FAMILIES if f.converted(module)), None)
        if family is not None:
            found.already(name, family.kind, module)
    for family in FAMILIES:
        family.nominate(model, options, found)
    return found


def trace_norms(model: nn.Module, found: Candidates, example: Any) -> Flow:
    """The probe stage: every read of each candidate norm's output. Dropouts the surgery converts let the norm's
    output through; an adapter's dropout that stays is a copy; activation and dropout functions called inside
    modules the surgery converts or knows are theirs (elsewhere the report names them)."""
    named = dict(model.named_modules())
    passing = {named[name] for name in (*found.folded, *found["dropout"])}
    copying = {named[name] for name in found.adapter_dropouts}
    converted = {name for name in found.entries if found.already_converted(name)} | set(found["functional"])
    quiet = {m for name, m in named.items() if name in converted or names_activation(m) or isinstance(m, nn.Dropout)}
    return probe(model, example, found.norms, quiet, passing, copying)


def make_plan(model: nn.Module, found: Candidates, flow: Flow, options: Options) -> Plan:
    """The plan stage: each family's changes and entries, in the order of :data:`FAMILIES`; the entries in the
    model's module order. Nothing changes."""
    plan = Plan(entries=list(found.entries.values()))
    for family in FAMILIES:
        plan.planning = family.kind
        added = len(plan.entries)
        family.plan(model, found, flow, options, plan)
        plan.entries[added:] = [replace(e, family=family.kind) for e in plan.entries[added:]]
    order = {name: i for i, name in enumerate(dict(model.named_modules()))}
    plan.entries.sort(key=lambda e: (order.get(e.name, len(order)), e.kind))
    return plan


def _drop_what_costs(model: nn.Module, example: Any, plan: Plan, surgery: Surgery, report: LowMemReport) -> Surgery:
    """Never worse, kind by kind: the converted model is measured without each separable family's changes, and every
    family without which it saves less is rolled back, with the two figures in its entries; if what remains still
    saves more than the stock model, everything is. Returns the surgery in force."""
    separable = [f.kind for f in FAMILIES if f.separable and f.kind in plan.kinds]
    costly: dict[str, int] = {}
    try:
        for kind in separable:
            surgery.rollback()
            surgery = plan.apply(model, frozenset({kind}))
            without = measure_saved(model, example).total_bytes
            if without < report.saved_bytes_after:
                costly[kind] = without
        if separable:
            surgery.rollback()
            surgery = plan.apply(model, frozenset(costly))
        if costly:
            meter = measure_saved(model, example)
            kept = set(plan.kinds) - set(costly)
            if meter.total_bytes < report.saved_bytes_after and meter.total_bytes <= report.saved_bytes_before and kept:
                report.roll_back(meter, costly)
                return surgery
            surgery.rollback()  # together they did not cost: the whole plan
            surgery = plan.apply(model)
    except BaseException:
        surgery.rollback()
        raise
    if report.saved_bytes_after <= report.saved_bytes_before:
        return surgery
    surgery.rollback()
    report.roll_back()
    return Surgery(model)


def run(report: LowMemReport, model: nn.Module, options: Options, example: Any) -> Surgery:
    """The stages, filling ``report``: decide (nothing changed yet), then change, check, measure and fit the
    budget, undoing every change if anything raises. Returns the applied surgery. The random number generators of
    the CPU and of the model's GPUs are left as they were: the probing steps draw from them (dropout masks, seeds),
    and a conversion must not move the draws of the training that follows (its shuffling, dropout, sampling). A model
    DeepSpeed ZeRO-3 partitioned is made whole for the duration."""
    with torch.random.fork_rng(devices=gpus_of(model)), whole(model):
        return _run(report, model, options, example)


def _run(report: LowMemReport, model: nn.Module, options: Options, example: Any) -> Surgery:
    found = nominate(model, options, example)
    flow = trace_norms(model, found, example)
    decided = make_plan(model, found, flow, options)
    has_example = example is not None
    report.entries, report.linears, report.pending = decided.entries, decided.linears, False
    report.probe = describe(example) if has_example else None
    if has_example and options.measure:
        meter, step = measure_step(model, example)
        report.record(meter, converted=False, step=step)
    checking = has_example and options.verify
    reference = (flow.outputs or eval_outputs(model, example)) if checking else None
    batch = training_batch(example) if checking else None
    # FSDP2 reshards around a step's backward: a check's step, then a rollback, leave its records astray
    training = checking and not found.fsdp_owners
    stock_step = training_step(model, batch) if training else None

    surgery = decided.apply(model)
    try:
        if reference is not None:
            verify(model, example, reference)
        if stock_step is not None:
            separable = frozenset(f.kind for f in FAMILIES if f.separable)
            surgery, failures = check_training(model, batch, stock_step, decided, surgery, separable)
            decided = decided.without(failures)
            report.reject(failures)
            surgery, decided, failures, error = check_approximation(model, batch, stock_step, decided, surgery)
            report.reject(failures)
            if any(e.kind == "activation" and e.status == "converted" for e in report.entries):
                report.gradient_error = error
        if report.saved_bytes_before is not None:
            report.record(measure_saved(model, example), converted=True)
            surgery = _drop_what_costs(model, example, decided, surgery, report)  # never worse, kind by kind
            if report.step_bytes_before is not None:  # the forward checkpoints: the step is the figure
                report.step_bytes_after = step_peak(model, example)
        if options.budget_mib is not None:
            report.budget = fit_budget(
                model, example, options.budget_mib, surgery, options.checkpoint, options.rungs, options.tile_tokens
            )
    except BaseException:
        surgery.rollback()
        raise
    return surgery
