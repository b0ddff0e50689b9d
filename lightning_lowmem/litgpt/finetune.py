"""LitGPT's own finetune scripts with lightning-lowmem: each GPT the script builds converts at its first training
forward (on rank 0's batch, the report printed once) and computes its training loss through the fused head
(:mod:`~lightning_lowmem.litgpt.head`). The script runs unchanged; two names in its module are replaced: ``GPT``
(by a subclass that does the above) and ``chunked_cross_entropy`` (by one that takes the hidden states)."""

from __future__ import annotations

import importlib
import inspect
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from lightning_lowmem.litgpt import head
from lightning_lowmem.surgery import CallArgs, Entry, Options, apply_lowmem, convert_at_first_forward
from lightning_lowmem.surgery.deferred import is_rank_zero, rank_zero_call

SUPPORTED = SpecifierSet(">=0.5.13,<0.6")
"""LitGPT versions whose finetune scripts this wraps (tested: 0.5.13): each script's training step is
``model(input_ids, ...)``, then ``chunked_cross_entropy`` of those logits (shifted by ``[..., :-1, :]``)."""

COMMANDS = {
    "finetune": "litgpt.finetune.lora",
    "finetune_lora": "litgpt.finetune.lora",
    "finetune_full": "litgpt.finetune.full",
    "finetune_adapter": "litgpt.finetune.adapter",
    "finetune_adapter_v2": "litgpt.finetune.adapter_v2",
}

_DETAIL = "LitGPT's chunked_cross_entropy through the fused linear + cross-entropy (no logits kept)"


def check_litgpt() -> Version:
    """LitGPT's installed version, if :data:`SUPPORTED`; otherwise a clear error."""
    try:
        installed = Version(version("litgpt"))
    except PackageNotFoundError:
        raise RuntimeError("lightning_lowmem.litgpt: LitGPT is not installed (pip install litgpt)") from None
    if installed not in SUPPORTED:
        raise RuntimeError(
            f"lightning_lowmem.litgpt: LitGPT {installed} is not supported (supported: {SUPPORTED}); "
            f"its finetune scripts may compute their loss differently"
        )
    return installed


def script(command: str) -> ModuleType:
    """The module of LitGPT's ``command``, checked to train as this wrapper expects."""
    if command not in COMMANDS:
        raise SystemExit(f"lightning_lowmem.litgpt: unknown command {command!r}; one of {', '.join(COMMANDS)}")
    module = importlib.import_module(COMMANDS[command])
    fit = inspect.getsource(module.fit) if hasattr(module, "fit") else ""
    if not (hasattr(module, "GPT") and hasattr(module, "chunked_cross_entropy") and "chunked_cross_entropy(" in fit):
        raise RuntimeError(f"lightning_lowmem.litgpt: {module.__name__} does not train as LitGPT 0.5's scripts do")
    return module


def patch(module: ModuleType, options: Options) -> type:
    """Replace ``module``'s ``GPT`` and ``chunked_cross_entropy`` (see the module docstring); returns the GPT
    class the script now builds."""
    stock_gpt = module.GPT

    class GPT(stock_gpt):
        __doc__ = stock_gpt.__doc__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.lowmem_report = convert_at_first_forward(self, lambda call: _convert(self, call, options))
            self.lowmem_head: head.FusedLossHead | None = None

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            stock = super().forward
            return (
                stock(*args, **kwargs) if self.lowmem_head is None else self.lowmem_head.forward(stock, *args, **kwargs)
            )

    GPT.__qualname__ = GPT.__name__ = stock_gpt.__name__
    module.GPT = GPT
    module.chunked_cross_entropy = head.chunked_cross_entropy
    return GPT


def _convert(model: Any, call: CallArgs, options: Options) -> None:
    """The surgery at the first training forward, on rank 0's batch, then the fused head."""
    call = rank_zero_call(call, next(model.parameters()).device)
    report = apply_lowmem(model, example_input=call, **options.as_dict())
    report.notes[:0] = model.lowmem_report.notes
    report.entries.append(_install_head(model, options))
    model.lowmem_report = report
    if is_rank_zero():
        print(f"lightning_lowmem.litgpt: model surgery\n{report.table()}", flush=True)


def _install_head(model: Any, options: Options) -> Entry:
    kind, name = "head", type(model).__name__
    if not options.head:
        return Entry("", kind, name, "left alone", "head=False: LitGPT's logits")
    refusal = head.head_refusal(model)
    if refusal is not None:
        return Entry("", kind, name, "left alone", refusal)
    model.lowmem_head = head.FusedLossHead(model)
    return Entry("", kind, name, "converted", _DETAIL)
