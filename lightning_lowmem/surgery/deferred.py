"""Surgery at the model's first forward, on that forward's own input, when no example input is given.

A one-shot forward pre-hook captures the call (:class:`CallArgs`), runs the conversion with it as
the example (probe, convert, verify: all or nothing), removes itself, and lets the forward go on
through the converted modules. Forwards in inference mode are let through unconverted: they
record no autograd graph, so the probe could not see what a training step saves.
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

    def describe(self) -> str:
        """E.g. ``model.backbone(tensor[8, 3, 32, 32], attention_mask=tensor[8, 16])``."""

        def show(value: Any) -> str:
            if isinstance(value, torch.Tensor):
                return f"tensor[{', '.join(map(str, value.shape))}]"
            return type(value).__name__

        parts = [show(a) for a in self.args] + [f"{k}={show(v)}" for k, v in self.kwargs.items()]
        return f"{self.module or 'model'}({', '.join(parts)})"


def at_first_call(root: nn.Module, run: Callable[[CallArgs], None], any_submodule: bool = False) -> Callable[[], None]:
    """Call ``run`` once, before the first forward of ``root`` outside inference mode (with ``any_submodule``:
    of whichever module of ``root`` is called first, e.g. ``self.model`` inside a LightningModule's
    ``training_step``). Returns a function that removes the hooks unused."""
    names = {module: name for name, module in root.named_modules()} if any_submodule else {root: ""}
    handles: list[RemovableHandle] = []

    def remove() -> None:
        for handle in handles:
            handle.remove()
        handles.clear()

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not handles or torch.is_inference_mode_enabled():
            return
        remove()  # before running: the probe calls the model again
        run(CallArgs(tuple(args), dict(kwargs), names[module]))

    for module in names:
        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
    return remove
