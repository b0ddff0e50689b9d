"""``apply_lowmem``: verified, all-or-nothing model surgery.

Activations (GELU erf/tanh, SiLU, QuickGELU, Mish) become k-bit step-derivative activations
wherever they are modules, except inside gated MLPs (LLaMA-family, timm SwiGLU / GluMlp), which
become one fused, exact, low-memory ``act(gate) * up`` (:mod:`lightning_lowmem.nn.gated`),
verified against the stock MLP. A LayerNorm / RMSNorm becomes a memory-sharing norm only where a
probe forward proves its output reaches nothing but linear layers (:mod:`.dataflow`); its affine
moves into those linears (:class:`~lightning_lowmem.nn.LowMemLinear`) without renaming any
parameter, so checkpoints stay interchangeable with the stock model. Every other ``nn.Linear``
recasts its weight in backward instead of saving a half-precision copy under autocast.

The pipeline (:func:`convert`): :func:`.plan.nominate` -> :func:`.plan.trace_norms` ->
:func:`.plan.make_plan` (nothing changed yet) -> apply the plan, check the outputs against the
stock model's, measure (:mod:`.convert`); any exception in the last step rolls everything back.
Without an example input it runs at the model's first training forward (:mod:`.deferred`).
With a budget, the fewest blocks are then checkpointed to fit it (:mod:`.budget`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch._dynamo import OptimizedModule

from lightning_lowmem.memory import MIB
from lightning_lowmem.nn import LowMemLinear
from lightning_lowmem.nn.linear import share_functional_linears
from lightning_lowmem.nn.peft import redundant_input_casts
from lightning_lowmem.surgery.budget import fit_budget
from lightning_lowmem.surgery.convert import Surgery, check_same, eval_outputs, measure_saved, output_tolerance
from lightning_lowmem.surgery.dataflow import describe, tensors_in, with_batch_size
from lightning_lowmem.surgery.deferred import CallArgs, at_first_call
from lightning_lowmem.surgery.detect import is_frozen_4bit_linear, repacking_4bit_layers, unpack_4bit_weight
from lightning_lowmem.surgery.plan import ExampleInputError, Options, make_plan, nominate, trace_norms
from lightning_lowmem.surgery.report import LowMemReport


def apply_lowmem(
    model: nn.Module,
    activation: str | bool = "auto",
    norm: str | bool = "auto",
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    *,
    linear: str | bool = "auto",
    gated: str | bool = "auto",
    example_input: Any = None,
    verify: bool = True,
    measure: bool = True,
    bits: int = 2,
    budget_mib: float | None = None,
    checkpoint: str | Sequence[str] | None = None,
) -> LowMemReport:
    """Convert ``model`` in place for low-memory backpropagation and report what changed.

    Args:
        model: any ``nn.Module`` (timm, Hugging Face, peft, custom; a ``torch.compile``'d module is
            converted through the module it compiles: convert before its first call). Parameters
            stay the same objects, so optimizers and DDP keep working; run it before FSDP (FSDP1) wraps
            the model; a model FSDP2's ``fully_shard`` sharded converts as it is.
        activation: ``"auto"`` converts every GELU / SiLU / QuickGELU / Mish module; ``False`` none.
        norm: ``"auto"`` converts each LayerNorm / RMSNorm whose output linear layers read
            (decided by a probe forward on a real input); ``False`` none.
        include: fnmatch patterns of qualified module names to consider (default: all).
        exclude: fnmatch patterns of module names to leave alone.
        linear: ``"auto"`` lets every other ``nn.Linear`` recast its weight in backward, so no
            half-precision weight copy is saved under autocast; ``False`` keeps them.
        gated: ``"auto"`` fuses ``act(gate) * up`` in every recognised gated MLP (exact; saves the
            gate, plus the up projection only when the down projection does not save the
            product anyway); ``False`` leaves them, and then ``activation`` converts their
            activation like any other.
        example_input: an input as Lightning's ``example_input_array`` (tensor, tuple of
            positional args, or dict of keyword args) for the probe that decides the norms, the
            check of the outputs, the memory measurement and the budget; without it they run on
            the first training forward's input (see below).
        verify: compare the converted model's outputs with the stock model's (rolls back and
            raises on a mismatch).
        measure: record the saved-for-backward bytes of one forward before and after.
        bits: bits per element of the activations' approximate backward: 2 (default, the
            paper's constants), or 1, 3, 4 (fitted tables; 3 is stored in 4 bits). Fewer bits
            save less memory, more bits a gradient closer to exact (benchmarks/RESULTS.md "kbit").
        budget_mib: fit the activation memory of a training step on the example input (its batch
            size) into this many MiB: after the conversion, the fewest repeated blocks are wrapped
            in activation checkpointing, the largest block's recomputation in backward included
            (:mod:`~lightning_lowmem.surgery.budget`); ``report.budget`` says which and what it
            measured. A budget below what checkpointing every block achieves raises ValueError
            naming that minimum.
        checkpoint: fnmatch patterns of the modules the budget may checkpoint (default: the
            repeated blocks, e.g. timm ``blocks.*``, Hugging Face ``layers.*``).

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
    options = Options.parse(
        model, activation=activation, norm=norm, linear=linear, gated=gated, include=include, exclude=exclude,
        bits=bits, budget_mib=budget_mib, checkpoint=checkpoint,
    )  # fmt: skip
    report = LowMemReport(notes=keep_4bit_layers_trainable(model))
    if example_input is None and options.needs_input:
        report.pending = True

        def convert_at_first_call(call: CallArgs) -> bool:
            try:
                convert(report, model, options, call, verify, measure)
            except ExampleInputError:
                return False  # the forward goes on, stock, and raises the model's own error
            return True

        at_first_call(model, convert_at_first_call)
        return report
    convert(report, model, options, example_input, verify, measure)
    return report


def plan(model: nn.Module, example_input: Any, budget_mib: float | None = None, **options: Any) -> LowMemReport:
    """What :func:`apply_lowmem` would do to ``model`` on ``example_input`` (with ``budget_mib``: which
    blocks it would checkpoint), without changing it: the surgery runs, is measured, and is undone.
    ``options`` are those of :func:`apply_lowmem`."""
    if example_input is None:
        raise ValueError("plan: an example input is needed to plan on")
    report = LowMemReport()
    convert(report, model, Options.parse(model, budget_mib=budget_mib, **options), example_input, True, True).rollback()
    return report


def max_batch_size(model: nn.Module, example_input: Any, budget_mib: float, **options: Any) -> int:
    """The largest batch whose activation memory after :func:`apply_lowmem` (without checkpointing)
    fits ``budget_mib``, ``model`` left unchanged.

    Activations grow linearly with the batch (dim 0 of every tensor of ``example_input``) and
    autocast's weight copies do not: the estimate extrapolates one measurement on the example,
    then measures the converted model at that size and steps down until it fits.
    """
    budget_bytes = round(budget_mib * MIB)
    surgery = convert(LowMemReport(), model, Options.parse(model, **options), example_input, False, False)
    try:
        meter = measure_saved(model, example_input)
        rows = _batch_size(example_input)
        per_row = max(meter.activation_bytes / rows, 1.0)
        size = int((budget_bytes - meter.weight_copy_bytes) // per_row)
        while size >= 1 and measure_saved(model, with_batch_size(example_input, size)).total_bytes > budget_bytes:
            size -= 1
    finally:
        surgery.rollback()
    if size < 1:
        raise ValueError(f"max_batch_size: not even one example fits {budget_mib:g} MiB of activations")
    return size


def _batch_size(example: Any) -> int:
    sizes = {t.shape[0] for t in tensors_in(example) if t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"max_batch_size: the example's tensors disagree on their batch size (dim 0): {sizes}")
    return sizes.pop()


def convert(
    report: LowMemReport, model: nn.Module, options: Options, example: Any, verify: bool, measure: bool
) -> Surgery:
    """The whole surgery, filling ``report``: decide (nothing changed yet), then change, check, measure and
    fit the budget, undoing every change if anything raises. Returns the applied surgery."""
    found = nominate(model, options)
    flow = trace_norms(model, example, found, options)
    decided = make_plan(model, found, flow, options)
    has_example = example is not None
    report.entries, report.linears, report.pending = decided.entries, decided.linears, False
    report.probe = describe(example) if has_example else None
    if has_example and measure:
        report.record(measure_saved(model, example), converted=False)
    reference = (flow.outputs or eval_outputs(model, example)) if has_example and verify else None

    surgery = Surgery(model, decided.replacements.values())
    try:
        for old, new in decided.replacements.items():
            surgery.replace(old, new)
        for caller in decided.functional_callers:
            surgery.keep_hooks(share_functional_linears(caller))
        for layer in list(redundant_input_casts(model, LowMemLinear)):  # LowMemLinear casts its input itself
            surgery.set(layer, "cast_input_dtype_enabled", False)
        if reference is not None:
            check_same(reference, eval_outputs(model, example), output_tolerance(model))
        if report.saved_bytes_before is not None:
            report.record(measure_saved(model, example), converted=True)
        if options.budget_mib is not None:
            report.budget = fit_budget(model, example, options.budget_mib, surgery, options.checkpoint)
    except BaseException:
        surgery.rollback()
        raise
    return surgery


def keep_4bit_layers_trainable(model: nn.Module) -> list[str]:
    """Switch off bitsandbytes' CPU repacking of 4-bit weights for good, at once (a deferred conversion waits for
    the first training forward, Lightning's sanity check comes before it): after an eval forward the model would
    train without gradients through those layers (:func:`.detect.repacking_4bit_layers`). Unpacks any weight
    an earlier eval forward repacked. Returns what it did, for the report."""
    repacking = repacking_4bit_layers(model)
    for layer in repacking:
        layer.support_avx512bf16_for_cpu = False
    unpacked = sum(unpack_4bit_weight(layer) for layer in model.modules() if is_frozen_4bit_linear(layer))
    notes = []
    if repacking:
        notes.append(
            f"bitsandbytes' CPU repacking switched off on {len(repacking)} 4-bit layers (after an eval forward "
            "they would train without input gradients)"
        )
    if unpacked:
        notes.append(f"{unpacked} 4-bit weights repacked by an earlier eval forward unpacked (block scales stay bf16)")
    return notes
