"""Surgery at the model's first training forward, on that forward's own input, when no example is given.

A one-shot forward pre-hook captures the call (:class:`CallArgs`), runs the conversion with it as
the example (probe, convert, verify: all or nothing), removes itself, and lets the forward go on
through the converted modules. Forwards without gradients (evaluation, inference mode) are let
through unconverted: they save nothing for backward, and a training step may take other paths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


@dataclass(frozen=True)
class CallArgs:
    """A captured call: ``root.get_submodule(module)(*args, **kwargs)``."""

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    module: str = ""


def at_first_call(root: nn.Module, run: Callable[[CallArgs], bool], any_submodule: bool = False) -> Callable[[], None]:
    """Call ``run`` before the first forward of ``root`` with gradients enabled (with ``any_submodule``: of
    whichever module of ``root`` is called first, e.g. ``self.model`` inside a LightningModule's
    ``training_step``). ``run`` returns False to be called again at the next such forward. Returns a
    function that removes the hooks unused."""
    names = {module: name for name, module in root.named_modules()} if any_submodule else {root: ""}
    handles: list[RemovableHandle] = []

    def install() -> None:
        handles.extend(module.register_forward_pre_hook(pre_hook, with_kwargs=True) for module in names)

    def remove() -> None:
        for handle in handles:
            handle.remove()
        handles.clear()

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not handles or not torch.is_grad_enabled():
            return
        remove()  # before running: the surgery must see hook-free modules, and it calls the model itself
        if not run(CallArgs(tuple(args), dict(kwargs), names[module])):
            install()

    install()
    return remove
