"""DeepSpeed ZeRO-3: converting a model whose parameters it partitioned, or before it does.

Outside a module's forward ZeRO-3 keeps a ``(0,)`` placeholder for each parameter (its full shape in ``ds_shape``), and
gathers it in hooks on the module that owns it. The surgery reads shapes and values and replaces modules: on a
partitioned model (``from_pretrained`` under a zero3 config, the Hugging Face Trainer's engine, ``apply_lowmem`` after
``deepspeed.initialize``) it runs on the model made :func:`whole` for its duration. Converting before the engine
(``LowMemBP`` under Lightning's ``DeepSpeedStrategy``) gives the engine a converted model to partition. Either way the
fused head asks ZeRO-3 to gather its weight for the loss's backward
(:func:`~lightning_lowmem.nn.causal_lm.gathered_for_backward`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn


def partitioned(model: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 holds ``model``'s parameters partitioned (a parameter with a ZeRO id and no data)."""
    return any(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())


@contextmanager
def whole(model: nn.Module) -> Iterator[None]:
    """``model`` whole for the surgery's duration where ZeRO-3 partitioned it: every parameter gathered on every rank
    (the probing steps read them all: for that time each rank holds the model's full size) with the engine's
    per-module hooks off, then partitioned again and the hooks registered anew over the converted modules (ZeRO-3
    gathers a module's parameters in hooks on that module; the surgery replaces modules). The parameters stay the same
    objects, unchanged in value (gathered read-only): the engine's optimizer keeps its partitions. A model partitioned
    by ``deepspeed.zero.Init`` and no engine yet gets its hooks from ``deepspeed.initialize`` later."""
    if not partitioned(model):
        yield
        return
    from deepspeed import zero
    from deepspeed.runtime.zero import parameter_offload, partition_parameters

    offload = engine_hooks_of(model)
    marks = {m: vars(m).pop("pre_bwd_fn") for m in model.modules() if "pre_bwd_fn" in vars(m)}  # the fused head's
    if offload is not None:
        offload._remove_module_hooks()
    try:
        with zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            yield
    finally:
        for module, mark in marks.items():
            vars(module).setdefault("pre_bwd_fn", mark)
        if offload is not None:
            for module in model.modules():  # what the engine gives each module at its start, for the new ones
                partition_parameters._init_external_params(module)
                parameter_offload.ensure_zero_ordered_dict(module)
            stack = len(parameter_offload.FWD_MODULE_STACK)
            offload.setup_zero_stage3_hooks()
            del parameter_offload.FWD_MODULE_STACK[stack:]  # it pushes the root again, as at the engine's start


def engine_hooks_of(model: nn.Module) -> Any:
    """The ``DeepSpeedZeRoOffload`` whose hooks gather ``model``'s parameters (``deepspeed.initialize`` built it, for
    ``model`` or a module holding it: Lightning's wrapper), found in the closure of a hook it puts on ``model`` (under
    DeepSpeed's wrappers); ``None`` where no engine hooked the model. Raises where one did but cannot be found."""
    functions = list(model._forward_pre_hooks.values())
    for _ in range(4):  # the hook, and the wrappers around it (NVTX, torch.compiler.disable)
        cells = [cell.cell_contents for f in functions for cell in getattr(f, "__closure__", None) or ()]
        cells += [f.__wrapped__ for f in functions if hasattr(f, "__wrapped__")]
        for owner in cells:
            root = getattr(owner, "module", None)
            hooks_model = isinstance(root, nn.Module) and any(m is model for m in root.modules())
            if hasattr(owner, "setup_zero_stage3_hooks") and hooks_model:
                return owner
        functions = [c for c in cells if callable(c)]
    if any("pre_bwd_fn" in vars(m) for m in model.modules()):
        raise RuntimeError(
            "DeepSpeed ZeRO-3's hooks are on the model but its engine's hook manager could not be found (DeepSpeed's "
            "hooks changed?): convert the model before deepspeed.initialize instead. Nothing was changed."
        )
    return None


@contextmanager
def init_suspended() -> Iterator[None]:
    """``deepspeed.zero.Init`` off for the duration, where one is active (Lightning's ``DeepSpeedStrategy`` runs
    ``configure_model`` in one): the modules the surgery makes are the model's, whole, for the engine to partition."""
    try:
        from deepspeed.runtime.zero import partition_parameters
    except ImportError:
        yield
        return
    active = partition_parameters.top_level_context is not None
    if active:
        partition_parameters.shutdown_init_context()
    try:
        yield
    finally:
        if active:
            partition_parameters.restore_init_context()
