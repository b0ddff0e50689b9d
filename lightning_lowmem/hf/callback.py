"""``LowMemCallback``: the surgery of :func:`~lightning_lowmem.apply_lowmem` in Hugging Face's ``Trainer`` and TRL's
``SFTTrainer``, one line: ``Trainer(..., callbacks=[LowMemCallback()])``.

At the start of training the model (a peft model too) is set to convert at its first training forward, on that
forward's batch and before it runs (the norms' probe needs a real batch): so the batch the data collator made, with
its ``labels`` (the fused head then computes the loss, no logits kept), ``position_ids`` of packed sequences and the
loss keyword arguments the Trainer adds (``num_items_in_batch``). Under accelerate's DDP every rank converts on rank
0's batch, so that the ranks decide alike; the report is printed once, by the main process. Parameters stay the same
objects, so the optimizer and DDP's buckets, made before, keep working.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import TrainerCallback

from lightning_lowmem.surgery import CallArgs, LowMemReport, Options, apply_lowmem, convert_at_first_forward
from lightning_lowmem.surgery.deferred import rank_zero_call
from lightning_lowmem.surgery.options import takes_options


@takes_options
class LowMemCallback(TrainerCallback):
    """Converts the Trainer's model at its first training forward (see the module docstring).

    Args:
        {options}

    After that forward ``callback.report`` is the :class:`~lightning_lowmem.LowMemReport` (``pending`` before).
    """

    def __init__(self, **options: Any) -> None:
        self.options = Options.parse(options, "LowMemCallback")
        self.report: LowMemReport | None = None
        self._print = True

    def on_train_begin(self, args, state, control, model: nn.Module | None = None, **kwargs: Any) -> None:
        if self.report is not None:
            return  # converted (or waiting to) already: a second train() call, or a resumed one
        if model is None:
            raise RuntimeError("LowMemCallback: the Trainer passed no model to on_train_begin")
        self._print = state.is_world_process_zero
        self.report = convert_at_first_forward(model, lambda call: self._convert(model, call))

    def _convert(self, model: nn.Module, call: CallArgs) -> None:
        """The surgery at the first training forward, on rank 0's batch."""
        call = rank_zero_call(call, next(model.parameters()).device)
        report = apply_lowmem(model, example_input=call, **self.options.as_dict())
        report.notes[:0] = self.report.notes
        self.report = report
        if self._print:
            print(f"LowMemCallback: model surgery\n{report.table()}", flush=True)
