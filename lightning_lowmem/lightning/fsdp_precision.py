"""LowMemFSDPPrecision: Lightning's ``FSDPPrecision`` with normalization layers kept in fp32.

``FSDPStrategy`` accepts only an ``FSDPPrecision``; this is one, as ``LowMemPrecision`` is Lightning's own
plugin type for the other strategies. FSDP (FSDP1) casts each wrapped unit's parameters to one dtype; its
``MixedPrecision._module_classes_to_ignore`` wraps the modules of the listed classes as units of their own,
in fp32, with their input cast to fp32 and their output back to the input's dtype. FSDP makes those
units only while auto-wrapping, so the plugin needs ``FSDPStrategy(auto_wrap_policy=...)`` whenever
the model has stock norms.

Memory-sharing norms stay in their block's unit: the consumer linear layers read the norm's affine
parameters again in backward, after a unit of its own would have resharded them. They compute their
statistics in fp32 from inputs of any dtype; their parameters are in the unit's dtype.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lightning.fabric.plugins.precision.fsdp import _PRECISION_INPUT
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from typing_extensions import override

from lightning_lowmem.lightning.precision import cast_except_norms, is_stock_norm, refuse_deepspeed, strategy_of

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


class LowMemFSDPPrecision(FSDPPrecision):
    """Precision plugin for ``FSDPStrategy``: Lightning's ``FSDPPrecision`` whose stock norms run in fp32.

    Its ``mixed_precision_config`` adds the model's stock norm classes (recognised by
    :func:`~lightning_lowmem.lightning.precision.is_norm`: ``nn.LayerNorm``, ``LlamaRMSNorm``, ...) to FSDP's
    ``_module_classes_to_ignore``: each stock norm becomes an FSDP unit of its own with fp32 parameters and
    statistics, returning the compute dtype. In ``*-true`` modes the model is cast to the half dtype
    except those norms. Memory-sharing norms (converted by :class:`~lightning_lowmem.LowMemBP`) stay in
    their block's unit, computing their statistics in fp32.

    Needs ``FSDPStrategy(auto_wrap_policy=...)`` (e.g. the set of transformer block classes) when the model
    has stock norms: FSDP splits the norms off only while auto-wrapping; setup raises otherwise. A
    ``FSDPStrategy(mixed_precision=...)`` of your own replaces this plugin's config, norms included.

    Args:
        precision: as ``FSDPPrecision``: ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``,
            ``"32-true"``.
        scaler: a ``ShardedGradScaler`` for ``"16-mixed"`` (one is created by default).

    Example::

        Trainer(strategy=FSDPStrategy(auto_wrap_policy={Block}), plugins=[LowMemFSDPPrecision("bf16-mixed")],
                callbacks=[LowMemBP()])
    """

    def __init__(self, precision: _PRECISION_INPUT = "bf16-mixed", scaler: ShardedGradScaler | None = None) -> None:
        super().__init__(precision, scaler)
        self.norm_classes: tuple[type[nn.Module], ...] = ()  # the model's stock norm classes, set by convert_module

    @override
    def __repr__(self) -> str:
        return f"LowMemFSDPPrecision({self.precision!r})"

    @property
    @override
    def mixed_precision_config(self) -> MixedPrecision:
        config = super().mixed_precision_config
        ignored = dict.fromkeys((*config._module_classes_to_ignore, *self.norm_classes))
        return dataclasses.replace(config, _module_classes_to_ignore=tuple(ignored))

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Record the model's stock norm classes and, in ``*-true`` modes, cast all but those norms
        (``FSDPStrategy`` calls this before wrapping the model)."""
        strategy = strategy_of(module)
        refuse_deepspeed(repr(self), strategy)
        norms = [m for m in module.modules() if is_stock_norm(m)]
        self.norm_classes = tuple(dict.fromkeys(type(m) for m in norms))
        wraps = not isinstance(strategy, FSDPStrategy) or "auto_wrap_policy" in strategy.kwargs
        if norms and self.precision != "32-true" and not wraps:
            names = ", ".join(sorted({c.__name__ for c in self.norm_classes}))
            raise MisconfigurationException(
                f"{self!r} keeps the model's {len(norms)} stock norms ({names}) in fp32 as FSDP units of their own, "
                "which FSDP makes only while auto-wrapping: pass FSDPStrategy(auto_wrap_policy={YourBlock, ...})"
            )
        if "true" in self.precision:
            cast_except_norms(module, self._desired_input_dtype, keep=is_stock_norm)
        return module
