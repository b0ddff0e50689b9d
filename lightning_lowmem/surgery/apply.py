"""``apply_lowmem``: verified, all-or-nothing model surgery.

Activations (GELU erf/tanh, SiLU, QuickGELU, Mish) become k-bit step-derivative activations
wherever they are modules, except inside gated MLPs (LLaMA-family, timm SwiGLU / GluMlp), which
become one fused, exact, low-memory ``act(gate) * up`` (:mod:`lightning_lowmem.nn.gated`),
verified against the stock MLP. A LayerNorm / RMSNorm becomes a memory-sharing norm only where a
probe forward proves its output reaches nothing but linear layers (:mod:`.dataflow`); its affine
moves into those linears (:class:`~lightning_lowmem.nn.LowMemLinear`) without renaming any
parameter, so checkpoints stay interchangeable with the stock model. Every other ``nn.Linear``
recasts its weight in backward instead of saving a half-precision copy under autocast.

The pipeline: :func:`.plan.nominate` -> :func:`.plan.trace_norms` -> :func:`.plan.make_plan`
(nothing changed yet) -> apply the plan, check the outputs against the stock model's, measure
(:mod:`.convert`); any exception in the last step rolls everything back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch._dynamo import OptimizedModule

from lightning_lowmem.nn import LowMemLinear
from lightning_lowmem.nn.linear import share_functional_linears
from lightning_lowmem.nn.peft import redundant_input_casts
from lightning_lowmem.surgery.convert import Surgery, check_same, eval_outputs, output_tolerance, saved_bytes
from lightning_lowmem.surgery.plan import Options, make_plan, nominate, trace_norms
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
) -> LowMemReport:
    """Convert ``model`` in place for low-memory backpropagation and report what changed.

    Args:
        model: any ``nn.Module`` (timm, Hugging Face, peft, custom; a ``torch.compile``'d module is
            converted through the module it compiles: convert before its first call). Parameters
            stay the same objects, so optimizers and DDP keep working; run it before FSDP wrapping.
        activation: ``"auto"`` converts every GELU / SiLU / QuickGELU / Mish module; ``False`` none.
        norm: ``"auto"`` converts each LayerNorm / RMSNorm whose output linear layers read
            (needs ``example_input`` to trace the data flow); ``False`` none.
        include: fnmatch patterns of qualified module names to consider (default: all).
        exclude: fnmatch patterns of module names to leave alone.
        linear: ``"auto"`` lets every other ``nn.Linear`` recast its weight in backward, so no
            half-precision weight copy is saved under autocast; ``False`` keeps them.
        gated: ``"auto"`` fuses ``act(gate) * up`` in every recognised gated MLP (exact; saves the
            gate, plus the up projection only when the down projection does not save the
            product anyway); ``False`` leaves them, and then ``activation`` converts their
            activation like any other.
        example_input: an input as Lightning's ``example_input_array`` (tensor, tuple of
            positional args, or dict of keyword args); enables norm conversion, the check of
            the outputs and the memory measurement.
        verify: compare the converted model's outputs with the stock model's (rolls back and
            raises on a mismatch).
        measure: record the saved-for-backward bytes of one forward before and after.
        bits: bits per element of the activations' approximate backward: 2 (default, the
            paper's constants), or 1, 3, 4 (fitted tables; 3 is stored in 4 bits). Fewer bits
            save less memory, more bits a gradient closer to exact (benchmarks/RESULTS.md "kbit").

    Returns:
        The :class:`LowMemReport`. Running it again on a converted model changes nothing.
    """
    if isinstance(model, OptimizedModule):  # torch.compile'd: convert the module it compiles
        model = model._orig_mod
    options = Options.parse(model, activation, norm, linear, gated, include, exclude, bits)
    found = nominate(model, options)
    flow = trace_norms(model, example_input, found, options)
    plan = make_plan(model, found, flow, options)
    has_example = example_input is not None
    report = LowMemReport(entries=plan.entries, linears=plan.linears)
    if has_example and measure:
        report.saved_bytes_before = saved_bytes(model, example_input)
    reference = (flow.outputs or eval_outputs(model, example_input)) if has_example and verify else None

    surgery = Surgery(model, plan.replacements.values())
    try:
        for old, new in plan.replacements.items():
            surgery.replace(old, new)
        for caller in plan.functional_callers:
            surgery.keep_hooks(share_functional_linears(caller))
        for layer in list(redundant_input_casts(model, LowMemLinear)):  # LowMemLinear casts its input itself
            surgery.set(layer, "cast_input_dtype_enabled", False)
        if reference is not None:
            check_same(reference, eval_outputs(model, example_input), output_tolerance(model))
        if report.saved_bytes_before is not None:
            report.saved_bytes_after = saved_bytes(model, example_input)
    except BaseException:
        surgery.rollback()
        raise
    return report
