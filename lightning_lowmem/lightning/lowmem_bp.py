"""``LowMemBP``: the model surgery of :func:`~lightning_lowmem.surgery.apply_lowmem` as a callback.

It must run after the model exists (also when it is built in ``configure_model``) and before
the strategy wraps it (DDP/FSDP), restores a checkpoint into it and creates the optimizers.
Lightning runs ``Callback.setup`` → ``LightningModule.setup`` → ``configure_model`` → checkpoint
restore → ``strategy.setup`` (wrap, optimizers), so the callback hooks into ``configure_model``
of the module instance: the surgery runs right after it, the last moment the bare model is seen.

Without ``example_input_array`` the norms need a real input: the surgery then runs at the first
training forward, on that forward's own input, before it runs (:mod:`~lightning_lowmem.surgery.deferred`).
Parameters keep their identity, so the optimizers and the DDP wrapper created meanwhile keep
working; every rank converts on rank 0's input, so all ranks decide alike. FSDP2 (``fully_shard``
in ``configure_model``) has sharded the model by then: its records of the parameters follow the
replaced modules (:mod:`~lightning_lowmem.surgery.fsdp`). FSDP1 (``FSDPStrategy``) flattens the
parameters when it wraps the model, so there the surgery must run before, on ``example_input_array``. DeepSpeed ZeRO-3
(``DeepSpeedStrategy(stage=3)``) partitions the parameters when it builds its engine: the surgery at the first batch
makes the model whole for its duration (:mod:`~lightning_lowmem.surgery.zero3`). ZeRO stages 1 and 2 keep the
parameters whole: the surgery runs as under DDP. Precision stays DeepSpeed's (``LowMemPrecision`` refuses it).
"""

from __future__ import annotations

from functools import partial
from typing import Any
from weakref import WeakSet

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_lowmem.surgery import (
    CallArgs,
    LowMemReport,
    Options,
    apply_lowmem,
    convert_at_first_forward,
    takes_options,
)
from lightning_lowmem.surgery.zero3 import init_suspended


@takes_options
class LowMemBP(Callback):
    """Convert the LightningModule for low-memory backpropagation before training starts.

    GELU/SiLU modules become ReGELU2/ReSiLU2, gated MLPs one fused exact product that saves less,
    LayerNorm/RMSNorm layers whose output linear layers read memory-sharing norms (decided by a
    probe forward on ``LightningModule.example_input_array``, or, without one, on the first
    training batch's forward), linear layers recast their weights in backward, dropouts keep a seed
    instead of a mask (a LoRA adapter's folded into its ``lora_A``). Parameter names do not change,
    so checkpoints load into the stock model and back. The report is printed once on rank 0 and
    kept in :attr:`report`.

    Strategies: DDP; FSDP2 (``ModelParallelStrategy``, ``fully_shard`` in ``configure_model``: the sharded
    model is converted); FSDP (``FSDPStrategy``, with :class:`~lightning_lowmem.LowMemFSDPPrecision`) only
    on ``example_input_array`` and without ``budget_mib``; DeepSpeed (``DeepSpeedStrategy``) stages 1 to 3 (stage 3
    without ``budget_mib``; with DeepSpeed's precision).

    Args:
        {options}
    """

    def __init__(self, **options: Any) -> None:
        self.options = Options.parse(options, "LowMemBP")
        self.report: LowMemReport | None = None
        self._printed = False
        self._converted: WeakSet[pl.LightningModule] = WeakSet()  # modules converted or waiting for their input

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if sum(isinstance(callback, LowMemBP) for callback in trainer.callbacks) > 1:
            raise MisconfigurationException(
                "Trainer(callbacks=...) holds more than one LowMemBP: a model is converted once; pass one LowMemBP "
                "with all the options"
            )
        if pl_module in self._converted:  # a repeated fit/validate/test: nothing left to do
            return
        configure_model = pl_module.configure_model  # the user's, or the no-op default

        def configure_then_convert() -> None:
            del pl_module.configure_model  # back to the class method: nothing left patched
            configure_model()
            self._convert(trainer, pl_module)

        # an instance attribute with its own code: Lightning sees the hook as overridden and
        # calls it inside its init contexts, after LightningModule.setup
        pl_module.configure_model = configure_then_convert

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pl_module.__dict__.pop("configure_model", None)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._print_once()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._print_once()

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._print_once()

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._print_once()

    def _print_once(self) -> None:
        if self.report is None or self._printed:
            return
        if self.report.pending:
            rank_zero_info(
                "LowMemBP: no example_input_array: the model is converted at the first training forward, "
                "on that batch, before it runs"
            )
            return
        budget = (
            ""
            if self.options.budget_mib is None
            else f"\nactivation budget {self.options.budget_mib:g} MiB: fitted on the first training batch"
        )
        rank_zero_info(f"LowMemBP: model surgery\n{self.report.table()}{budget}")
        self._printed = True

    def _convert(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        example: Any = pl_module.example_input_array
        self._converted.add(pl_module)
        budget = self.options.budget_mib
        probe_later = example is None and self.options.norm
        strategy = trainer.strategy
        if (probe_later or budget is not None) and isinstance(strategy, FSDPStrategy):
            raise MisconfigurationException(
                "LowMemBP with FSDPStrategy must convert the model before FSDP wraps it (FSDP flattens the "
                "parameters), so on LightningModule.example_input_array and without budget_mib (fitted on the first "
                "training batch); set example_input_array, or shard with FSDP2 (ModelParallelStrategy), where the "
                "model is converted at the first training batch"
            )
        if budget is not None and isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3:
            raise MisconfigurationException(
                "LowMemBP with DeepSpeed ZeRO-3 takes no budget_mib (the budget's checkpointing is fitted on the first "
                "training batch, inside ZeRO-3's engine): drop budget_mib, or use ZeRO stage 1 or 2"
            )
        if not probe_later:
            with trainer.precision_plugin.forward_context(), init_suspended():
                options = {**self.options.as_dict(), "budget_mib": None}
                self.report = apply_lowmem(pl_module, example_input=example, **options)
            if budget is None:
                return
        # the rest runs on the first training batch: the norms' probe, or the budget, which is per batch
        pending = convert_at_first_forward(pl_module, partial(self._convert_on, trainer, pl_module), any_submodule=True)
        if probe_later:
            self.report = pending

    def _convert_on(self, trainer: pl.Trainer, pl_module: pl.LightningModule, call: CallArgs) -> None:
        """The surgery at the first training forward (inside ``training_step``: precision context on)."""
        call = trainer.strategy.broadcast(call, src=0)  # every rank probes rank 0's input: one decision
        report = apply_lowmem(pl_module, example_input=call, **self.options.as_dict())
        decision = (tuple((entry.name, entry.status) for entry in report.entries), report.checkpointed)
        if not trainer.strategy.reduce_boolean_decision(decision == trainer.strategy.broadcast(decision), all=True):
            raise RuntimeError("LowMemBP: the ranks converted the model differently; stopping every rank")
        if self.report.pending:
            report.notes[:0] = self.report.notes
            self.report = report
            self._print_once()
        else:  # converted at setup on example_input_array: this run only fitted the budget
            self.report.budget = report.budget
            rank_zero_info(f"LowMemBP: on the first training batch, {report.probe}: {report.budget.summary()}")
