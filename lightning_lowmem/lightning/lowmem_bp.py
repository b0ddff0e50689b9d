"""``LowMemBP``: the model surgery of :func:`~lightning_lowmem.surgery.apply_lowmem` as a callback.

It must run after the model exists (also when it is built in ``configure_model``) and before
the strategy wraps it (DDP/FSDP), restores a checkpoint into it and creates the optimizers.
Lightning runs ``Callback.setup`` → ``LightningModule.setup`` → ``configure_model`` → checkpoint
restore → ``strategy.setup`` (wrap, optimizers), so the callback hooks into ``configure_model``
of the module instance: the surgery runs right after it, the last moment the bare model is seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_lowmem.surgery import LowMemReport, apply_lowmem


class LowMemBP(Callback):
    """Convert the LightningModule for low-memory backpropagation before training starts.

    GELU/SiLU modules become ReGELU2/ReSiLU2, gated MLPs one fused exact product that saves less,
    LayerNorm/RMSNorm layers whose output reaches only linear layers memory-sharing norms
    (decided by a probe forward on ``LightningModule.example_input_array``; without it no norm
    is converted); linear layers recast their weights in backward. Parameter names do not
    change, so checkpoints load into the stock model and back. The report is printed once at fit start on rank 0 and kept in
    :attr:`report`. The arguments are those of :func:`~lightning_lowmem.surgery.apply_lowmem`.
    """

    def __init__(
        self,
        activation: str | bool = "auto",
        norm: str | bool = "auto",
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        linear: str | bool = "auto",
        gated: str | bool = "auto",
        verify: bool = True,
        measure: bool = True,
        bits: int = 2,
    ) -> None:
        self.options = {
            "activation": activation, "norm": norm, "include": include, "exclude": exclude,
            "linear": linear, "gated": gated, "verify": verify, "measure": measure, "bits": bits,
        }  # fmt: skip
        self.report: LowMemReport | None = None
        self._printed = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        configure_model = pl_module.configure_model  # the user's, or the no-op default

        def configure_then_convert() -> None:
            del pl_module.configure_model  # back to the class method: nothing left patched
            configure_model()
            self._convert(trainer, pl_module)

        # an instance attribute with its own code: Lightning sees the hook as overridden and
        # calls it inside its init contexts, after LightningModule.setup
        pl_module.configure_model = configure_then_convert

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pl_module.__dict__.pop("configure_model", None)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.report is not None and not self._printed:
            rank_zero_info(f"LowMemBP: model surgery at setup, probed on example_input_array\n{self.report.table()}")
            self._printed = True

    def _convert(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        example: Any = pl_module.example_input_array
        with trainer.precision_plugin.forward_context():
            report = apply_lowmem(pl_module, example_input=example, **self.options)
        if self.report is None or report.converted:  # a repeated fit/validate/test changes nothing
            self.report = report
