"""Gated MLPs (SwiGLU, GeGLU) whose ``act(gate) * up`` is one low-memory op.

``mode="auto"`` chooses per forward, from the layer that reads the product ``h``: when it saves
``h`` for its own backward (a trainable down projection, or a LoRA adapter reading ``h``
directly), the op saves ``gate`` and shares that ``h`` (``"gate"``: one extra activation);
otherwise it saves ``gate`` and ``up`` (``"gate_up"``: exact, two). See
:mod:`lightning_lowmem.ops.gated`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from lightning_lowmem.nn.adapters import saves_its_input
from lightning_lowmem.nn.norm import is_norm_output
from lightning_lowmem.ops.autocast import autocast_dtype
from lightning_lowmem.ops.gated import MODES, gated_activation
from lightning_lowmem.registry.activations import get_activation


def product_mode(consumer: nn.Module | None) -> str:
    """The gated op's mode for a product read by ``consumer``: share the product where that layer saves it."""
    return "gate" if saves_its_input(consumer) else "gate_up"


def gated_product(gate: torch.Tensor, up: torch.Tensor, activation: str, consumer: nn.Module | None) -> torch.Tensor:
    """``act(gate) * up`` where a forward computes it with functions (``F.silu(self.fc_1(x)) * self.fc_2(x)``),
    fused; ``consumer`` is the layer reading the product, if that is all that reads it. Operands that broadcast
    are multiplied as the forward did (the fused op needs one shape)."""
    if gate.shape != up.shape:
        return get_activation(activation).stock(gate) * up
    return gated_activation(gate, up, activation, product_mode(consumer))


@dataclass(frozen=True)
class GatedLayout:
    """A stock gated MLP by its child names: all of them, the activation, the projection reading the input, and
    an attribute that tells it from a plain MLP with the same children (timm's ``gate_last``)."""

    children: frozenset[str]
    activation: str
    first: str
    marker: str | None = None

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` has this layout's children (it may have more) and marker."""
        return self.children <= set(module._modules) and (self.marker is None or hasattr(module, self.marker))


class GatedMLPBase(nn.Module, ABC):
    """``output(act(gate) * up)`` with ``gate, up = gate_and_up(x)``; subclasses fix the layout.

    Subclasses register the projections under the stock model's names (state_dict keys do not
    change), say which layer reads the product directly (``consumer``), for ``mode="auto"``, and
    which stock layouts they replace (``layouts``, built by ``from_stock``): the registry of gated
    MLPs that the surgery reads (:func:`gated_layouts`).
    """

    layouts: ClassVar[tuple[GatedLayout, ...]] = ()

    @classmethod
    def from_stock(cls, stock: nn.Module, activation: str) -> GatedMLPBase:
        """The fused module over ``stock``'s own children (one of :attr:`layouts`)."""
        return cls(stock, activation)

    def __init__(self, activation: str = "silu", mode: str = "auto") -> None:
        super().__init__()
        get_activation(activation, type(self).__name__, gated=True)
        if mode not in ("auto", *MODES):
            raise ValueError(f"{type(self).__name__}: mode must be 'auto', 'gate_up' or 'gate', got {mode!r}")
        self.activation, self.mode = activation, mode

    @abstractmethod
    def gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two projections of the input."""

    @abstractmethod
    def output(self, h: torch.Tensor) -> torch.Tensor:
        """Everything after the product (the down projection, and any dropout or norm)."""

    @abstractmethod
    def consumer(self) -> nn.Module | None:
        """The layer that receives the product itself (``None`` if anything comes in between)."""

    def product_dropout(self) -> tuple[str, str] | None:
        """The child names of a dropout between the product and the layer reading it, and of that layer (T5's
        ``dropout`` and ``wo``): the surgery can fold the one into the other, which then reads the product itself."""
        return None

    def resolved_mode(self) -> str:
        """``mode``, with ``"auto"`` resolved for the current ``requires_grad`` flags."""
        return product_mode(self.consumer()) if self.mode == "auto" else self.mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = autocast_dtype(x)
        if x.dtype == torch.float32 and compute is not None and not is_norm_output(x):
            # what autocast does in each projection anyway, once: gate and up (and their LoRA
            # adapters) then save one half-precision copy of x instead of one each (a
            # memory-sharing norm's output needs none: its consumers save the norm's tensor)
            x = x.to(compute)
        gate, up = self.gate_and_up(x)
        return self.output(gated_activation(gate, up, self.activation, self.resolved_mode()))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, mode={self.mode!r}"


class GatedMLP(GatedMLPBase):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: the LLaMA / Mistral / Qwen MLP, same names.

    Args:
        hidden_size: the input and output features.
        intermediate_size: the features of the gated product.
        activation: a gated activation of the registry (``"silu"``: SwiGLU, ``"gelu"``/``"gelu_tanh"``: GeGLU).
        bias: whether the three projections have biases.
        mode: ``"auto"`` (chosen per forward from ``down_proj``), ``"gate_up"`` or ``"gate"`` (see the module).
    """

    layouts = (GatedLayout(frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"}), "act_fn", "gate_proj"),)

    def __init__(
        self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False, mode: str = "auto"
    ) -> None:
        super().__init__(activation, mode)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    @classmethod
    def from_projections(
        cls,
        gate_proj: nn.Module,
        up_proj: nn.Module,
        down_proj: nn.Module,
        activation: str = "silu",
        mode: str = "auto",
    ) -> GatedMLP:
        """Wrap existing projection modules (plain, LoRA-adapted, ...) as they are."""
        new = cls.__new__(cls)
        GatedMLPBase.__init__(new, activation, mode)
        new.gate_proj, new.up_proj, new.down_proj = gate_proj, up_proj, down_proj
        return new

    @classmethod
    def from_stock(cls, stock: nn.Module, activation: str) -> GatedMLP:
        return cls.from_projections(stock.gate_proj, stock.up_proj, stock.down_proj, activation)

    def gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_proj(x), self.up_proj(x)

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(h)

    def consumer(self) -> nn.Module:
        return self.down_proj


class TimmGluMlp(GatedMLPBase):
    """timm's ``SwiGLU`` (``fc1_g``, ``fc1_x``) or ``GluMlp`` (one ``fc1`` whose halves are gate and
    up) with the fused product; children keep their names, so state_dict keys do not change."""

    layouts = (
        GatedLayout(frozenset({"fc1_g", "fc1_x", "act", "drop1", "norm", "fc2", "drop2"}), "act", "fc1_g"),
        # timm's plain Mlp has the same children: ``gate_last`` tells them apart
        GatedLayout(frozenset({"fc1", "act", "drop1", "norm", "fc2", "drop2"}), "act", "fc1", marker="gate_last"),
    )

    def __init__(self, stock: nn.Module, activation: str, mode: str = "auto") -> None:
        super().__init__(activation, mode)
        self.packed = "fc1" in stock._modules
        self.gate_last = bool(getattr(stock, "gate_last", False))
        for name in ("fc1",) if self.packed else ("fc1_g", "fc1_x"):
            self.add_module(name, stock._modules[name])
        for name in ("drop1", "norm", "fc2", "drop2"):
            self.add_module(name, stock._modules[name])

    def gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.packed:
            return self.fc1_g(x), self.fc1_x(x)
        first, second = self.fc1(x).chunk(2, dim=-1)
        return (second, first) if self.gate_last else (first, second)

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(h))))

    def consumer(self) -> nn.Module | None:
        return self.fc2 if _passes_through(self.drop1) and isinstance(self.norm, nn.Identity) else None

    def product_dropout(self) -> tuple[str, str] | None:
        return ("drop1", "fc2") if isinstance(self.norm, nn.Identity) else None


def _passes_through(dropout: nn.Module) -> bool:
    """Whether ``dropout`` hands on its very input (identity, or p = 0)."""
    return isinstance(dropout, nn.Identity) or getattr(dropout, "p", None) == 0


class PackedGatedMLP(GatedMLPBase):
    """``down_proj(act(gate) * up)`` with ``gate, up = gate_up_proj(x).chunk(2, dim=-1)``: the Phi-3 / GLM MLP,
    same child names."""

    layouts = (GatedLayout(frozenset({"gate_up_proj", "down_proj", "activation_fn"}), "activation_fn", "gate_up_proj"),)

    def __init__(self, stock: nn.Module, activation: str, mode: str = "auto") -> None:
        super().__init__(activation, mode)
        self.gate_up_proj, self.down_proj = stock.gate_up_proj, stock.down_proj

    def gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return gate, up

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(h)

    def consumer(self) -> nn.Module:
        return self.down_proj


class T5GatedMLP(GatedMLPBase):
    """``wo(dropout(act(wi_0(x)) * wi_1(x)))``: T5 v1.1 / Flan-T5 / mT5's ``T5DenseGatedActDense``, same child
    names, with its cast of the product to ``wo``'s dtype (T5 keeps ``wo`` in fp32 in half-precision models)."""

    layouts = (GatedLayout(frozenset({"wi_0", "wi_1", "wo", "dropout", "act"}), "act", "wi_0"),)  # T5 v1.1, Flan-T5

    def __init__(self, stock: nn.Module, activation: str, mode: str = "auto") -> None:
        super().__init__(activation, mode)
        self.wi_0, self.wi_1, self.wo, self.dropout = stock.wi_0, stock.wi_1, stock.wo, stock.dropout

    def gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.wi_0(x), self.wi_1(x)

    def output(self, h: torch.Tensor) -> torch.Tensor:
        h = self.dropout(h)
        weight = self.wo.weight
        if isinstance(weight, torch.Tensor) and h.dtype != weight.dtype and weight.dtype != torch.int8:
            h = h.to(weight.dtype)
        return self.wo(h)

    def consumer(self) -> nn.Module | None:
        return self.wo if _passes_through(self.dropout) else None

    def product_dropout(self) -> tuple[str, str] | None:
        return "dropout", "wo"


def gated_layouts() -> Iterator[tuple[GatedLayout, type[GatedMLPBase]]]:
    """Every stock layout a fused class replaces, with that class: this module's, then any subclass users define."""
    pending = [GatedMLPBase]
    while pending:
        cls = pending.pop(0)
        yield from ((layout, cls) for layout in cls.layouts)
        pending.extend(cls.__subclasses__())
