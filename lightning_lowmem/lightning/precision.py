"""LowMemPrecision: Lightning precision plugins that keep normalization layers in fp32.

Under any half precision, norms compute their statistics and hold their parameters in
fp32, while their outputs come out in the compute dtype. The output dtype matters for
memory: a norm returning fp32 under autocast makes every consuming linear save its own
half copy of it (three copies for separate q/k/v projections); a norm returning the
compute dtype hands all of them one tensor, and a memory-sharing norm's saved output is
then the very storage the linears save.

``LowMemPrecision(precision)`` builds the plugin of the stock type for the literal, so that
every ``isinstance`` check in Lightning (grad-scaler checkpoint state, ``ThroughputMonitor``'s
compute dtype, strategies) sees what it sees for ``Trainer(precision=...)``. The norm handling
is in module-level functions, for other plugin types (:class:`~lightning_lowmem.LowMemFSDPPrecision`) to share.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal, Self, get_args
from weakref import WeakKeyDictionary

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_lowmem.memory.saved_tensors import observer
from lightning_lowmem.nn import MemorySharingNorm
from lightning_lowmem.registry.norms import is_normalization

_MIXED = Literal["16-mixed", "bf16-mixed"]
_TRUE_HALF = Literal["16-true", "bf16-true"]
_PRECISION = Literal[_MIXED, _TRUE_HALF, "32-true"]

# One output hook per norm module, whichever plugin installed it last (a model can be
# set up by several trainers, or several times by one).
_OUTPUT_HOOKS: WeakKeyDictionary[nn.Module, RemovableHandle] = WeakKeyDictionary()


def is_norm(module: nn.Module) -> bool:
    """A normalization layer of the norm registry's (:func:`~lightning_lowmem.registry.norms.is_normalization`:
    torch's, any class whose name ends in ``Norm``, classes given to ``register_norm``) or a memory-sharing norm."""
    return isinstance(module, MemorySharingNorm) or is_normalization(module)


def is_stock_norm(module: nn.Module) -> bool:
    """A norm (:func:`is_norm`) that is not a memory-sharing norm."""
    return is_normalization(module) and not isinstance(module, MemorySharingNorm)


def cast_except_norms(module: nn.Module, dtype: torch.dtype, keep: Callable[[nn.Module], bool] = is_norm) -> None:
    """Cast ``module``'s floating parameters and buffers to ``dtype``, and those of the norms ``keep`` picks to fp32."""
    norms = {id(m) for m in module.modules() if keep(m)}
    for submodule in module.modules():
        target = torch.float32 if id(submodule) in norms else dtype
        submodule._apply(partial(_cast_floating, target), recurse=False)


def cast_norm_outputs(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Make every stock norm in ``module`` return the compute dtype: the autocast dtype under
    autocast, else ``dtype`` (``None``: leave the output as it is). Memory-sharing norms already do."""
    for norm in module.modules():
        if not is_stock_norm(norm):
            continue
        previous = _OUTPUT_HOOKS.pop(norm, None)
        if previous is not None:
            previous.remove()
        # a partial of a module-level function: a converted model stays picklable. Marked as an observer:
        # the surgery may replace the norm (at the first training forward, after this plugin's setup) by a
        # memory-sharing norm, which returns the compute dtype itself
        _OUTPUT_HOOKS[norm] = norm.register_forward_hook(observer(partial(_output_to_compute_dtype, dtype)))


def _output_to_compute_dtype(dtype: torch.dtype | None, module: nn.Module, args: Any, output: Any) -> Any:
    """Cast a floating output to the compute dtype; float64 is left alone, as autocast leaves it (and the
    surgery's check of a norm runs it in float64)."""
    if not isinstance(output, Tensor) or not output.is_floating_point() or output.dtype == torch.float64:
        return output
    if torch.is_autocast_enabled(output.device.type):
        dtype = torch.get_autocast_dtype(output.device.type)
    return output if dtype is None or output.dtype == dtype else output.to(dtype)


def _cast_floating(dtype: torch.dtype, tensor: Tensor) -> Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def refuse_deepspeed(owner: str, strategy: object) -> None:
    """Raise if ``strategy`` is DeepSpeed's: it takes over the model's parameters and precision, so neither
    the surgery nor the norm handling can be checked there."""
    if isinstance(strategy, DeepSpeedStrategy):
        raise MisconfigurationException(
            f"{owner} does not support DeepSpeedStrategy (DeepSpeed partitions the parameters and runs its own "
            "precision); shard with FSDP2 instead: Trainer(strategy=ModelParallelStrategy(...)) with fully_shard "
            "in configure_model, or FSDPStrategy with LowMemFSDPPrecision"
        )


def strategy_of(module: nn.Module) -> object:
    """The strategy of the Trainer ``module`` (a LightningModule) is attached to, else ``None``."""
    return getattr(getattr(module, "_trainer", None), "strategy", None)


def _check_precision(owner: str, precision: object, accepted: tuple[str, ...]) -> None:
    if precision not in accepted:
        raise ValueError(f"{owner}(precision={precision!r}): precision must be one of {', '.join(accepted)}")


class LowMemPrecision(Precision):
    """Precision plugin: Lightning's precision modes with normalization layers kept in fp32.

    ``LowMemPrecision(precision)`` builds the plugin of Lightning's type for the literal:

    - ``"16-mixed"``/``"bf16-mixed"``: a :class:`LowMemMixedPrecision`, Lightning's
      ``MixedPrecision`` (autocast, and a grad scaler for fp16);
    - ``"16-true"``/``"bf16-true"``: a :class:`LowMemHalfPrecision`, Lightning's
      ``HalfPrecision``, which converts the model to half except its norms, whose parameters
      and buffers stay fp32;
    - ``"32-true"``: a ``LowMemPrecision``, a plain ``Precision`` that changes nothing.

    In every half mode a stock norm's output is cast to the compute dtype (the autocast dtype,
    or the half dtype for ``*-true``), so all its consumers share one tensor. Memory-sharing
    norms (:class:`~lightning_lowmem.nn.MSLayerNorm`, :class:`~lightning_lowmem.nn.MSRMSNorm`)
    already compute in fp32 and return the compute dtype, and are left as they are.

    Norms are recognised by :func:`is_norm`. Torch's norm kernels accept a half input with
    fp32 parameters and accumulate in fp32; a custom norm (e.g. HF ``LlamaRMSNorm``)
    computes its statistics however it is written (HF upcasts to fp32 explicitly).

    Memory, against Lightning's own plugin for the same literal: under autocast, a stock
    norm feeding several linears saves one half copy instead of one per linear (LLaMA q/k/v,
    gate/up); a consumer that saves only a slice of the output (ViT's class-token head) now
    keeps the whole half output alive instead of a half copy of the slice. Under ``*-true``
    the fp32 statistics a torch norm saves (mean/rstd, one per row) double in size.
    Numerics: in a post-norm model (BERT) a norm's output is also the next residual, which
    is then carried in the compute dtype up to the next norm, as it is under ``*-true``.

    Strategies: DDP, and FSDP2 (``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``) in
    ``"bf16-mixed"`` (or ``"32-true"``): FSDP2 shards each module's parameters in one dtype, so the
    ``*-true`` modes, which would keep the norms' parameters fp32 beside half ones, are refused at setup.
    For ``FSDPStrategy`` use :class:`~lightning_lowmem.LowMemFSDPPrecision` (Lightning requires an
    ``FSDPPrecision`` there). DeepSpeed is refused at setup; XLA requires its own plugin.

    Args:
        precision: one of ``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``, ``"bf16-true"``,
            ``"32-true"``; ``trainer.precision`` reports it.
        device: device type for autocast (``"cuda"``, ``"cpu"``, ...), mixed modes only. Default:
            ``"cuda"`` when CUDA is available, else ``"cpu"``; it must match the accelerator.
        scaler: a ``torch.amp.GradScaler`` for ``"16-mixed"`` (one is created by default).

    Example::

        Trainer(plugins=[LowMemPrecision("bf16-mixed")], callbacks=[LowMemBP()])

    or in a LightningCLI config::

        trainer:
          plugins:
            - class_path: lightning_lowmem.LowMemPrecision
              init_args: {precision: bf16-mixed}
    """

    def __new__(
        cls,
        precision: _PRECISION = "bf16-mixed",
        device: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> Self:
        _check_precision(cls.__name__, precision, get_args(_PRECISION))
        if scaler is not None and precision != "16-mixed":
            raise MisconfigurationException(f"LowMemPrecision({precision!r}) does not use a grad scaler, got {scaler}")
        return super().__new__(_PLUGINS[precision] if cls is LowMemPrecision else cls)

    def __getnewargs__(self) -> tuple[str]:
        """Pickle and deepcopy rebuild through ``__new__``: the literal picks the class again."""
        return (self.precision,)

    @override
    def __repr__(self) -> str:
        """The call that builds this plugin (Lightning's error messages show it)."""
        return f"LowMemPrecision({self.precision!r})"

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Refuse DeepSpeed (the strategy calls this at its setup); the modes' plugins convert the module."""
        refuse_deepspeed(repr(self), strategy_of(module))
        return module


class LowMemMixedPrecision(LowMemPrecision, MixedPrecision):
    """Lightning's ``MixedPrecision`` whose stock norms return the autocast dtype (see :class:`LowMemPrecision`)."""

    def __init__(
        self,
        precision: _MIXED = "bf16-mixed",
        device: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        super().__init__(precision, device or ("cuda" if torch.cuda.is_available() else "cpu"), scaler)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        module = super().convert_module(module)
        cast_norm_outputs(module, None)  # outside autocast (a model used by hand), outputs stay as they are
        return module

    @override
    def connect(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Refuse a model on another device type than autocast's: autocast would silently do nothing."""
        parameter = next(model.parameters(), None)
        if parameter is not None and parameter.device.type != self.device:
            raise MisconfigurationException(
                f"{self!r} autocasts on device type {self.device!r}, but the model is on {parameter.device.type!r}; "
                f"pass LowMemPrecision({self.precision!r}, device={parameter.device.type!r})"
            )
        return super().connect(model, optimizers, lr_schedulers)


class LowMemHalfPrecision(LowMemPrecision, HalfPrecision):
    """Lightning's ``HalfPrecision`` whose norms keep fp32 parameters and buffers and return the
    half dtype (see :class:`LowMemPrecision`). ``device`` and ``scaler`` are accepted because
    ``LowMemPrecision(...)`` passes them on; with no autocast and no scaler they are unused."""

    def __init__(self, precision: _TRUE_HALF = "bf16-true", device: str | None = None, scaler: None = None) -> None:
        _check_precision(type(self).__name__, precision, get_args(_TRUE_HALF))
        super().__init__(precision)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        module = super().convert_module(module)
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            raise MisconfigurationException(
                f"{self!r} keeps the norms' parameters in fp32, and FSDP2 (fully_shard) shards each module's "
                "parameters in one dtype; use LowMemPrecision('bf16-mixed')"
            )
        cast_except_norms(module, self._desired_input_dtype)
        cast_norm_outputs(module, self._desired_input_dtype)
        return module


_PLUGINS: dict[str, type[LowMemPrecision]] = {
    "16-mixed": LowMemMixedPrecision,
    "bf16-mixed": LowMemMixedPrecision,
    "16-true": LowMemHalfPrecision,
    "bf16-true": LowMemHalfPrecision,
    "32-true": LowMemPrecision,
}
