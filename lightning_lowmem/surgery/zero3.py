"""DeepSpeed ZeRO-3: a model whose parameters it has partitioned is refused, with what to do instead.

Outside a module's forward ZeRO-3 keeps a ``(0,)`` placeholder for each parameter (its full shape in ``ds_shape``), and
gathers it in hooks on the module that owns it: the surgery reads shapes and values and replaces modules, which would
then own parameters no hook gathers. Converting before ``deepspeed.initialize`` (``LowMemBP`` under Lightning's
``DeepSpeedStrategy``, ``LowMemCallback`` under the Hugging Face Trainer) gives the engine a converted model to
partition; the fused head then asks ZeRO-3 to gather its weight for the loss's backward
(:func:`~lightning_lowmem.nn.causal_lm.gathered_for_backward`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


def partitioned(model: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 holds ``model``'s parameters partitioned (a parameter with a ZeRO id and no data)."""
    return any(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())


def refuse_partitioned(model: nn.Module, owner: str) -> None:
    """Raise where ZeRO-3 partitioned ``model``'s parameters: nothing is changed."""
    if partitioned(model):
        raise ValueError(
            f"{owner}: DeepSpeed ZeRO-3 has partitioned the model's parameters (deepspeed.initialize or "
            "deepspeed.zero.Init ran first); convert before it: apply_lowmem(model, ...) before deepspeed.initialize, "
            "LowMemBP under Lightning's DeepSpeedStrategy, LowMemCallback under the Hugging Face Trainer. Nothing was "
            "changed."
        )


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
