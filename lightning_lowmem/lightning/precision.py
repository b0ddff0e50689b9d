"""LowMemPrecision: Lightning precision plugin that keeps normalization layers in fp32.

Under any half precision, norms compute their statistics and hold their parameters in
fp32, while their outputs come out in the compute dtype. The output dtype matters for
memory: a norm returning fp32 under autocast makes every consuming linear save its own
half copy of it (three copies for separate q/k/v projections); a norm returning the
compute dtype hands all of them one tensor, and a memory-sharing norm's saved output is
then the very storage the linears save.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal, get_args
from weakref import WeakKeyDictionary

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_lowmem.nn import MSLayerNorm, MSRMSNorm
from lightning_lowmem.surgery import DeferredAffineNorm

_PRECISION = Literal["16-mixed", "bf16-mixed", "16-true", "bf16-true", "32-true"]
_HALF = {"16": torch.float16, "bf16": torch.bfloat16}
_NORM_NAME = re.compile(r"norm(\d+d)?$", re.IGNORECASE)
_TORCH_NORMS = (
    nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)  # fmt: skip
_MEMORY_SHARING_NORMS = (MSLayerNorm, MSRMSNorm, DeferredAffineNorm)

# One output hook per norm module, whichever plugin installed it last (a model can be
# set up by several trainers, or several times by one).
_OUTPUT_HOOKS: WeakKeyDictionary[nn.Module, RemovableHandle] = WeakKeyDictionary()


def is_norm(module: nn.Module) -> bool:
    """A torch normalization layer (or subclass), a memory-sharing norm, or any module whose
    class name ends in ``Norm`` (``LlamaRMSNorm``, timm ``RmsNorm``, ``T5LayerNorm``, ...)."""
    return isinstance(module, (*_TORCH_NORMS, *_MEMORY_SHARING_NORMS)) or bool(_NORM_NAME.search(type(module).__name__))


class LowMemPrecision(Precision):
    """Precision plugin: Lightning's precision modes with normalization layers kept in fp32.

    ``"16-mixed"``/``"bf16-mixed"`` run the model under autocast like Lightning's
    ``MixedPrecision`` (with a grad scaler for fp16); ``"16-true"``/``"bf16-true"`` convert
    the model to half like ``HalfPrecision``, except its norms, whose parameters and
    buffers stay fp32; ``"32-true"`` changes nothing. In every half mode a stock norm's
    output is cast to the compute dtype (the autocast dtype, or the half dtype for
    ``*-true``), so all its consumers share one tensor. Memory-sharing norms
    (:class:`~lightning_lowmem.nn.MSLayerNorm`, :class:`~lightning_lowmem.nn.MSRMSNorm`)
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

    Not supported yet: strategies that require their own precision plugin (FSDP,
    DeepSpeed, XLA); Lightning refuses the combination when the Trainer is built.

    Args:
        precision: one of ``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``, ``"bf16-true"``,
            ``"32-true"``; ``trainer.precision`` reports it.
        device: device type for autocast (``"cuda"``, ``"cpu"``, ...). Default: ``"cuda"``
            when CUDA is available, else ``"cpu"``; it must match the accelerator.
        scaler: a ``torch.amp.GradScaler`` for ``"16-mixed"`` (one is created by default).

    Example::

        Trainer(plugins=[LowMemPrecision("bf16-mixed")], callbacks=[LowMemBP()])

    or in a LightningCLI config::

        trainer:
          plugins:
            - class_path: lightning_lowmem.LowMemPrecision
              init_args: {precision: bf16-mixed}
    """

    def __init__(
        self,
        precision: _PRECISION = "bf16-mixed",
        device: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if precision not in get_args(_PRECISION):
            raise ValueError(
                f"LowMemPrecision(precision={precision!r}): precision must be one of {', '.join(get_args(_PRECISION))}"
            )
        if scaler is not None and precision != "16-mixed":
            raise MisconfigurationException(f"LowMemPrecision({precision!r}) does not use a grad scaler, got {scaler}")
        self.precision = precision
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        prefix, kind = precision.split("-")
        self._half_dtype: torch.dtype | None = _HALF.get(prefix)
        self._autocast = kind == "mixed"
        # The stock plugin for this literal does everything except the norm handling.
        self._base: Precision
        if self._autocast:
            self._base = MixedPrecision(precision, self.device, scaler)  # type: ignore[arg-type]
        elif self._half_dtype is not None:
            self._base = HalfPrecision(precision)  # type: ignore[arg-type]
        else:
            self._base = Precision()

    def __repr__(self) -> str:
        return f"LowMemPrecision({self.precision!r})"

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The grad scaler (``"16-mixed"`` only); ``trainer.scaler`` reads it."""
        return getattr(self._base, "scaler", None)

    # -- the model -------------------------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert to the half dtype (``*-true``) except norms, which stay or become fp32;
        in half modes, make stock norms return the compute dtype."""
        if self._half_dtype is None:
            return module
        norms = [m for m in module.modules() if is_norm(m)]
        if not self._autocast:
            to_half = _cast_floating(self._half_dtype)
            norm_ids = {id(m) for m in norms}
            for submodule in module.modules():
                if id(submodule) not in norm_ids:
                    submodule._apply(to_half, recurse=False)
            for norm in norms:
                norm._apply(_cast_floating(torch.float32), recurse=False)
        for norm in norms:
            if not isinstance(norm, _MEMORY_SHARING_NORMS):
                self._install_output_hook(norm)
        return module

    def _install_output_hook(self, norm: nn.Module) -> None:
        previous = _OUTPUT_HOOKS.pop(norm, None)
        if previous is not None:
            previous.remove()
        _OUTPUT_HOOKS[norm] = norm.register_forward_hook(self._output_to_compute_dtype)

    def _output_to_compute_dtype(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not isinstance(output, Tensor) or not output.is_floating_point():
            return output
        device_type = output.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        elif self._autocast:
            return output  # a mixed-precision model used outside autocast: leave it alone
        else:
            dtype = self._half_dtype
        return output if output.dtype == dtype else output.to(dtype)

    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> tuple[nn.Module, list, list]:
        """Refuse a model on another device type than autocast's: autocast would silently do nothing."""
        parameter = next(model.parameters(), None)
        if self._autocast and parameter is not None and parameter.device.type != self.device:
            raise MisconfigurationException(
                f"LowMemPrecision({self.precision!r}) autocasts on device type {self.device!r}, but the model is on "
                f"{parameter.device.type!r}; pass LowMemPrecision({self.precision!r}, device={parameter.device.type!r})"
            )
        return model, optimizers, lr_schedulers

    # -- delegated to the stock plugin for this literal --------------------------------------
    def forward_context(self) -> AbstractContextManager:
        return self._base.forward_context()

    def convert_input(self, data: Any) -> Any:
        return self._base.convert_input(data)

    def tensor_init_context(self) -> AbstractContextManager:
        return self._base.tensor_init_context()

    def module_init_context(self) -> AbstractContextManager:
        return self._base.module_init_context()

    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        return self._base.pre_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        return self._base.optimizer_step(optimizer, model, closure, **kwargs)

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        kwargs = {} if gradient_clip_algorithm is None else {"gradient_clip_algorithm": gradient_clip_algorithm}
        self._base.clip_gradients(optimizer, clip_val, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self._base.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._base.load_state_dict(state_dict)


def _cast_floating(dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    return lambda t: t.to(dtype) if t.is_floating_point() else t
