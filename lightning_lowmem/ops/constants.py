"""Step-derivative constants of ReGELU2 / ReSiLU2 (paper, appendix E).

The approximate activation is ``a1*relu(x-c1) + a2*relu(x-c2) + a3*relu(x-c3)``
with ``a3 = 1 - a1 - a2``, so its derivative is a 4-level step function of the
number of thresholds ``x`` exceeds: ``levels[code]`` with ``code = sum(x > c_i)``.
"""

from __future__ import annotations

from typing import NamedTuple


class StepDerivative(NamedTuple):
    """Ascending thresholds and the derivative value of each segment between them."""

    thresholds: tuple[float, ...]
    levels: tuple[float, ...]


def _from_relu_weights(a1: float, a2: float, c: tuple[float, float, float]) -> StepDerivative:
    return StepDerivative(thresholds=c, levels=(0.0, a1, a1 + a2, 1.0))


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

SUPPORTED_BITS = (1, 2, 3, 4)
# Activation kinds of the kernels -> their name in the fitted tables.
_TABLE_NAME = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "silu": "silu", "quick_gelu": "quick_gelu", "mish": "mish"}
_PAPER_2BIT = {"gelu": GELU_2BIT, "gelu_tanh": GELU_2BIT, "silu": SILU_2BIT}


def step_derivative(kind: str, bits: int = 2) -> StepDerivative:
    """The ``bits``-bit step derivative of an activation (``gelu``, ``gelu_tanh``, ``silu``, ``quick_gelu``, ``mish``).

    At 2 bits GELU (both forms) and SiLU use the paper's constants; everything else comes from the
    fitted tables of :mod:`lightning_lowmem.ops.step_tables` (3-bit codes are stored in 4 bits).
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if kind not in _TABLE_NAME:
        raise ValueError(f"no step derivative for activation {kind!r}; known: {sorted(_TABLE_NAME)}")
    if bits == 2 and kind in _PAPER_2BIT:
        return _PAPER_2BIT[kind]
    from lightning_lowmem.ops.step_tables import TABLES

    return TABLES[_TABLE_NAME[kind]][bits]


def storage_bits(bits: int) -> int:
    """Bits each code occupies in memory: 1, 2 or 4 (3-bit codes are stored as 4)."""
    return 4 if bits == 3 else bits
