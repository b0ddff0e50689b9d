"""The activations with a low-memory backward: one entry each, describing the activation fully.

An entry says how stock PyTorch computes the activation (the forward the low-memory op runs bit
for bit, and the reference the surgery checks a module against), which step derivative replaces its
derivative in backward (``levels[code]``, ``code`` the number of ascending ``thresholds`` an input
exceeds: paper, section 4 and appendix E), which modules may compute it (torch classes, a class-name
pattern for timm's and Hugging Face's, and the classes users register), and what the kernels know
of it: ``kernel`` is the kernels' id (forward and codes in one pass, and the fused gated product;
``None`` runs the stock function and a separate codes pass), ``gated`` the name of the gated MLP
built on it (SwiGLU), where the kernels have its gated formulas. At 2 bits GELU and SiLU use the
paper's constants; every other width the fitted tables of :mod:`.step_tables`
(``python -m lightning_lowmem.approx --write --activations NAME`` fits a new entry's).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem.registry.step_tables import TABLES

Bits = Literal[1, 2, 3, 4]
SUPPORTED_BITS: tuple[int, ...] = get_args(Bits)


class StepDerivative(NamedTuple):
    """Ascending thresholds and the derivative value of each segment between them."""

    thresholds: tuple[float, ...]
    levels: tuple[float, ...]


def _from_relu_weights(a1: float, a2: float, c: tuple[float, float, float]) -> StepDerivative:
    """The paper's form ``a1*relu(x-c1) + a2*relu(x-c2) + a3*relu(x-c3)``, ``a3 = 1 - a1 - a2``."""
    return StepDerivative(thresholds=c, levels=(0.0, a1, a1 + a2, 1.0))


# Paper, appendix E (full precision).
GELU_2BIT = _from_relu_weights(
    -0.04922261145617846,
    1.0979632065417297,
    (-3.1858810036855245, -0.001178821281161997, 3.190832613414926),
)
SILU_2BIT = _from_relu_weights(
    -0.04060357190528599,
    1.080925428529668,
    (-6.3050461001646445, -0.0008684942046214787, 6.325815242089708),
)


def check_bits(owner: str, bits: object) -> int:
    """``bits`` if it is a supported code width, else a ValueError naming ``owner``."""
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"{owner}: bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return int(bits)  # type: ignore[arg-type]


def code_bits(bits: int) -> int:
    """Bits one code occupies in memory: 1, 2 or 4 (3-bit codes are stored as 4)."""
    return 4 if bits == 3 else bits


@dataclass(frozen=True)
class Activation:
    """One activation: its exact stock forward, its step derivatives, the modules that compute it, its kernels."""

    name: str
    label: str
    stock: Callable[[torch.Tensor], torch.Tensor]
    modules: tuple[type[nn.Module], ...] = ()
    pattern: str | None = None
    """Class names that nominate a parameter-free leaf module (matched case-insensitively)."""
    functions: tuple[Callable[..., torch.Tensor], ...] = ()
    """torch functions that may compute it when a forward calls them (``F.silu(self.fc_1(x))``)."""
    paper_2bit: StepDerivative | None = None
    kernel: str | None = None
    gated: str | None = None
    steps: dict[int, StepDerivative] = field(init=False, repr=False, compare=False)
    """Its step derivative per code width: the fitted tables, and the paper's constants where it has them."""

    def __post_init__(self) -> None:
        if self.gated is not None and self.kernel is None:
            raise ValueError(f"activation {self.name!r}: a gated MLP needs the kernels' formulas (kernel=...)")
        fitted = {bits: StepDerivative(*table) for bits, table in TABLES.get(self.name, {}).items()}
        object.__setattr__(self, "steps", fitted | ({2: self.paper_2bit} if self.paper_2bit is not None else {}))

    def step_derivative(self, bits: int = 2, owner: str | None = None) -> StepDerivative:
        """The ``bits``-bit step derivative; a clear error (naming ``owner``) for a width with no fitted table."""
        step = self.steps.get(check_bits(owner or self.label, bits))
        if step is None:
            raise ValueError(
                f"{owner or self.label}: no {bits}-bit step derivative of {self.label} has been fitted; run "
                f"`python -m lightning_lowmem.approx --write --activations {self.name}`"
            )
        return step

    def names_module(self, module: nn.Module) -> bool:
        """Whether ``module``'s class (a torch class, or a name matching :attr:`pattern`) says it may compute this."""
        if isinstance(module, self.modules):
            return True
        return self.pattern is not None and re.search(self.pattern, type(module).__name__, re.IGNORECASE) is not None


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)  # CLIP / OpenCLIP / HF QuickGELUActivation, same bits


ACTIVATIONS: dict[str, Activation] = {
    entry.name: entry
    for entry in (
        Activation(
            "gelu", "GELU (erf)", F.gelu, (nn.GELU,), "gelu", (F.gelu,), GELU_2BIT, kernel="gelu", gated="GeGLU"
        ),
        Activation(
            "gelu_tanh", "GELU (tanh)", lambda x: F.gelu(x, approximate="tanh"), (nn.GELU,), "gelu", (F.gelu,),
            GELU_2BIT, kernel="gelu_tanh", gated="GeGLU (tanh)",
        ),
        Activation(
            "silu", "SiLU", F.silu, (nn.SiLU,), "silu|swish", (F.silu,), SILU_2BIT, kernel="silu", gated="SwiGLU"
        ),
        Activation("quick_gelu", "QuickGELU", _quick_gelu, pattern="gelu"),
        Activation("mish", "Mish", F.mish, (nn.Mish,), "mish", (F.mish,)),
    )
}  # fmt: skip
GATED_ACTIVATIONS: tuple[str, ...] = tuple(name for name, entry in ACTIVATIONS.items() if entry.gated)

REGISTERED: dict[type[nn.Module], str] = {}
"""User classes -> the activation their instances compute (:func:`register_activation`)."""


FUNCTIONS = frozenset(function for entry in ACTIVATIONS.values() for function in entry.functions)
"""Every torch function an activation of the registry may be called as."""


def get_activation(name: str, owner: str = "lightning_lowmem", gated: bool = False) -> Activation:
    """The registry entry of ``name`` (a ValueError naming ``owner`` and the choices otherwise)."""
    entry = ACTIVATIONS.get(name) if isinstance(name, str) else None
    if entry is None or (gated and not entry.gated):
        choices = GATED_ACTIVATIONS if gated else tuple(ACTIVATIONS)
        raise ValueError(f"{owner}: activation must be one of {choices}, got {name!r}")
    return entry


def register_activation(cls: type[nn.Module], like: str) -> type[nn.Module]:
    """Declare that instances of ``cls`` compute the activation ``like`` (a registry name: "gelu", "gelu_tanh",
    "silu", "quick_gelu", "mish"), so that the surgery converts them whatever the class is called.

    Each instance is still run on a probe and compared with ``like`` before it is replaced; one that computes
    something else is left alone, with the difference measured in the report. Returns ``cls``.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_activation: expected an nn.Module subclass, got {cls!r}")
    REGISTERED[cls] = get_activation(like, "register_activation").name
    return cls


def registered_as(module: nn.Module) -> Activation | None:
    """The activation ``module``'s class was registered as (the nearest registered base class), if any."""
    for cls in type(module).__mro__:
        if cls in REGISTERED:
            return ACTIVATIONS[REGISTERED[cls]]
    return None
