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
