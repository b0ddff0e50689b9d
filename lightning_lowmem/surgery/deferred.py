"""Surgery at the model's first training forward, on that forward's own input, when no example is given.

A one-shot forward pre-hook captures the call (:class:`~.example.CallArgs`), runs the conversion with it
as the example (probe, convert, verify: all or nothing), removes itself, and lets the forward go on
through the converted modules. Forwards without gradients (evaluation, inference mode) are let
through unconverted: they save nothing for backward, and a training step may take other paths. A
model that cannot run the input is left as it was, the forward goes on and raises the model's own
error, and the next training forward tries again. A call whose ``forward`` Lightning's strategies redirected to
``training_step`` (DDP, DeepSpeed, FSDP: the wrapper's forward runs the step) is not a forward: the hook waits for
the step's own forward call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.hooks import RemovableHandle

from lightning_lowmem.nn.adapters.bitsandbytes import keep_4bit_layers_trainable
from lightning_lowmem.surgery.example import CallArgs
from lightning_lowmem.surgery.probe import ExampleInputError
from lightning_lowmem.surgery.report import LowMemReport


def convert_at_first_forward(
    model: nn.Module, convert: Callable[[CallArgs], object], *, any_submodule: bool = False
) -> LowMemReport:
    """Call ``convert`` on the first forward of ``model`` with gradients enabled (with ``any_submodule``: of
    whichever module of ``model`` is called first, e.g. ``self.model`` inside a LightningModule's
    ``training_step``), before that forward runs. Returns the pending report; ``convert`` fills it in (or
    its own). bitsandbytes' 4-bit layers are kept trainable at once: evaluation forwards (Lightning's sanity
    check) come before the first training forward."""
    report = LowMemReport(pending=True, notes=keep_4bit_layers_trainable(model))
    names = {module: name for name, module in model.named_modules()} if any_submodule else {model: ""}
    handles: list[RemovableHandle] = []

    def install() -> None:
        handles.extend(module.register_forward_pre_hook(pre_hook, with_kwargs=True) for module in names)

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not handles or not torch.is_grad_enabled() or redirected(module):
            return
        for handle in handles:  # before running: the surgery must see hook-free modules, and calls the model itself
            handle.remove()
        handles.clear()
        try:
            convert(CallArgs(tuple(args), dict(kwargs), names[module]))
        except ExampleInputError:
            install()  # the forward goes on, stock, and raises the model's own error

    install()
    return report


def redirected(module: nn.Module) -> bool:
    """Whether ``module``'s forward is, for this call, Lightning's redirection to another method (its strategies'
    ``_ForwardRedirection`` patches ``forward`` to run ``training_step`` through the wrapper)."""
    forward = vars(module).get("forward")
    return "_ForwardRedirection" in getattr(forward, "__qualname__", "")


def rank_zero_call(call: CallArgs, device: torch.device) -> CallArgs:
    """Rank 0's captured call on every rank (its tensors on this rank's ``device``), so that data-parallel ranks,
    each with its own batch, convert alike; the call itself in a single process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return call
    box = [_moved(call, torch.device("cpu")) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return _moved(box[0], device)


def is_rank_zero() -> bool:
    """Whether this process prints: rank 0, or the only one."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _moved(call: CallArgs, device: torch.device) -> CallArgs:
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t
    return CallArgs(tree_map(move, call.args), tree_map(move, call.kwargs), call.module)
