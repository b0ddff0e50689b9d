"""The activations with a low-memory backward: one registry, one entry per activation.

An entry says how stock PyTorch computes the activation (the forward the low-memory op runs,
bit for bit, and the reference model surgery checks a module against) and which step
derivative replaces its derivative in backward: ``levels[code]`` with ``code`` the number of
ascending ``thresholds`` an input exceeds (paper, section 4 and appendix E). At 2 bits GELU and
SiLU use the paper's constants; every other width and activation the fitted tables of
:mod:`.step_tables` (``python -m lightning_lowmem.approx`` regenerates them). ``gated`` entries
are the ones the gated-MLP kernels have formulas for; their name is the kernels' activation id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F

from lightning_lowmem.ops.step_tables import TABLES

ActivationName = Literal["gelu", "gelu_tanh", "silu", "quick_gelu", "mish"]
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
    """One activation: its exact stock forward and its step derivatives."""

    name: ActivationName
    label: str
    stock: Callable[[torch.Tensor], torch.Tensor]
    paper_2bit: StepDerivative | None = None
    gated: bool = False
    steps: dict[int, StepDerivative] = field(init=False, repr=False, compare=False)
    """Its step derivative per code width, looked up on every call: the paper's constants where it has them."""

    def __post_init__(self) -> None:
        fitted = {bits: StepDerivative(*table) for bits, table in TABLES[self.name].items()}
        object.__setattr__(self, "steps", fitted | ({2: self.paper_2bit} if self.paper_2bit is not None else {}))

    def step_derivative(self, bits: int = 2) -> StepDerivative:
        """The ``bits``-bit step derivative (the paper's constants where it has them)."""
        return self.steps[check_bits(self.label, bits)]


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)  # CLIP / OpenCLIP / HF QuickGELUActivation, same bits


ACTIVATIONS: dict[str, Activation] = {
    entry.name: entry
    for entry in (
        Activation("gelu", "GELU (erf)", F.gelu, GELU_2BIT, gated=True),
        Activation("gelu_tanh", "GELU (tanh)", lambda x: F.gelu(x, approximate="tanh"), GELU_2BIT, gated=True),
        Activation("silu", "SiLU", F.silu, SILU_2BIT, gated=True),
        Activation("quick_gelu", "QuickGELU", _quick_gelu),
        Activation("mish", "Mish", F.mish),
    )
}
GATED_ACTIVATIONS: tuple[str, ...] = tuple(name for name, entry in ACTIVATIONS.items() if entry.gated)


def get_activation(name: str, owner: str = "lightning_lowmem", gated: bool = False) -> Activation:
    """The registry entry of ``name`` (a ValueError naming ``owner`` and the choices otherwise)."""
    entry = ACTIVATIONS.get(name) if isinstance(name, str) else None
    if entry is None or (gated and not entry.gated):
        choices = GATED_ACTIVATIONS if gated else tuple(ACTIVATIONS)
        raise ValueError(f"{owner}: activation must be one of {choices}, got {name!r}")
    return entry
