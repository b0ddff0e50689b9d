"""Fit k-bit step derivatives for any activation (paper, section 4.2 and appendix E).

The activation ``h`` is approximated by ``sum_i a_i * relu(x - c_i)`` over ``2^k - 1`` ReLUs
with ``sum_i a_i = 1`` (same slope as ``h`` at +infinity), minimising the L2 distance
``int_A^B (h - h~)^2 dx`` over a window outside of which both tails are negligible. The
derivative of the fit is a ``2^k``-level step function: what the backward pass multiplies by.

For fixed thresholds the weights solve a linear least-squares problem, so only the thresholds
are searched (variable projection): a few Nelder-Mead restarts, then a polish. Needs scipy.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from lightning_lowmem.registry.activations import ACTIVATIONS as REGISTRY
from lightning_lowmem.registry.activations import StepDerivative, check_bits

Activation = Callable[[np.ndarray], np.ndarray]


def _on_tensors(fn: Callable[[torch.Tensor], torch.Tensor]) -> Activation:
    """A torch activation as a function of float64 numpy arrays."""

    def on_arrays(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return fn(torch.from_numpy(x)).double().numpy()

    return on_arrays


# The paper's integration windows (appendix E, tails bounded by 1e-8); others are found numerically.
PAPER_WINDOWS = {"gelu": math.sqrt(-2.0 * math.log(1e-8)), "silu": -2.0 * math.log(1e-8 / 2.0)}


def _numpy_activation(owner: str, fn: str | Callable) -> Activation:
    """``fn`` as a function of float64 numpy arrays: a name of the activation registry, a function taking
    numpy arrays, or a torch callable (``F.gelu``, ``nn.Mish()``, a lambda on tensors), which is then
    evaluated on float64 tensors. One call on a probe array decides which."""
    if isinstance(fn, str):
        if fn not in REGISTRY:
            raise ValueError(f"{owner}: unknown activation {fn!r}; known: {sorted(REGISTRY)}")
        return _on_tensors(REGISTRY[fn].stock)
    if not callable(fn):
        raise TypeError(f"{owner}: fn must be an activation name or a callable, got {type(fn).__name__}")

    on_tensors = _on_tensors(fn)
    probe = np.linspace(-1.0, 1.0, 5)
    for candidate in (fn, on_tensors):
        try:
            output = np.asarray(candidate(probe), dtype=np.float64)
        except (TypeError, AttributeError) as error:  # a torch callable given an array, or the reverse
            refusal = error
            continue
        if output.shape != probe.shape:
            raise ValueError(f"{owner}: fn must return one value per input element, got shape {output.shape}")
        return candidate
    raise TypeError(f"{owner}: fn {fn!r} takes neither a numpy array nor a float64 torch tensor") from refusal


def integration_window(fn: Activation, tail: float = 1e-8) -> float:
    """Smallest B with ``|h(x) - relu(x)| * |x| < tail`` for ``|x| >= B`` (bounds both tails' integrals)."""
    x = np.linspace(0.0, 200.0, 400_001)
    gap = np.maximum(np.abs(fn(x) - x), np.abs(fn(-x))) * np.maximum(x, 1.0)
    inside = np.nonzero(gap >= tail)[0]
    return float(x[min(inside[-1] + 1, len(x) - 1)]) if len(inside) else 1.0


class _Objective:
    """L2 error of the best ReLU combination for given thresholds, on a Simpson grid."""

    def __init__(self, fn: Activation, window: float, points: int = 20_001) -> None:
        self.x = np.linspace(-window, window, points)
        self.h = fn(self.x)
        simpson = np.ones(points)
        simpson[1:-1:2], simpson[2:-1:2] = 4.0, 2.0
        self.w = np.sqrt(simpson * (self.x[1] - self.x[0]) / 3.0)

    def solve(self, thresholds: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """Error, optimal weights (summing to 1) and the error's gradient in the thresholds."""
        relus = np.maximum(self.x[:, None] - thresholds[None, :], 0.0)
        last = relus[:, -1]
        design = (relus[:, :-1] - last[:, None]) * self.w[:, None]
        target = (self.h - last) * self.w
        free, *_ = np.linalg.lstsq(design, target, rcond=None)
        weights = np.append(free, 1.0 - free.sum())
        residual = target - design @ free  # = w * (h - h~)
        # Envelope theorem: at optimal weights, d/dc_i = 2 a_i * int (h - h~) [x > c_i] dx.
        above = self.x[:, None] > thresholds[None, :]
        gradient = 2.0 * weights * ((residual * self.w) @ above)
        return float(residual @ residual), weights, gradient

    def __call__(self, thresholds: np.ndarray) -> tuple[float, np.ndarray]:
        error, _, gradient = self.solve(thresholds)
        return error, gradient


def _starts(fn: Activation, window: float, count: int, restarts: int, seed: int) -> list[np.ndarray]:
    """Starting thresholds: evenly spread ones, curvature quantiles (symmetrised too), random jitters."""
    starts = [np.linspace(-s, s, count) if count > 1 else np.zeros(1) for s in (1.0, 2.0, 4.0, 8.0)]
    x = np.linspace(-window, window, 40_001)
    curvature = np.abs(np.gradient(np.gradient(fn(x), x), x))
    mass = np.cumsum(curvature)
    mass /= mass[-1]
    quantiles = np.interp((np.arange(count) + 0.5) / count, mass, x)
    starts += [quantiles, 0.5 * (quantiles - quantiles[::-1])]
    rng = np.random.default_rng(seed)
    scale = max(float(np.ptp(quantiles)), 1.0) / (count + 1)
    starts += [np.sort(quantiles + rng.normal(0.0, scale, count)) for _ in range(restarts)]
    return starts


def _window(fn: str | Callable, activation: Activation, window: float | None) -> float:
    """``window`` if given, else the paper's for its activations, else one found numerically."""
    if window:
        return window
    if isinstance(fn, str) and fn in PAPER_WINDOWS:
        return PAPER_WINDOWS[fn]
    return integration_window(activation)


def fit_step_derivative(
    fn: str | Callable, bits: int, window: float | None = None, restarts: int | None = None, seed: int = 0
) -> StepDerivative:
    """Fit the ``bits``-bit step derivative of ``fn``: a name of the activation registry, a numpy function,
    or a torch callable such as ``F.gelu`` or ``nn.Mish()``.

    Returns the ``2^bits - 1`` ascending thresholds and the ``2^bits`` derivative values of the
    segments between them (the first is 0, the last 1). Every start is optimised on a coarse
    grid; the best few are polished on the fine one. ``restarts`` random starts are added
    (default: more for more bits).
    """
    bits = check_bits("fit_step_derivative", bits)
    activation = _numpy_activation("fit_step_derivative", fn)
    from scipy.optimize import minimize

    window = _window(fn, activation, window)
    count = 2**bits - 1
    restarts = (0, 2, 8, 16)[bits - 1] if restarts is None else restarts
    options = {"ftol": 1e-15, "gtol": 1e-12, "maxiter": 2000}
    coarse = _Objective(activation, window, points=4_001)
    results = []
    for start in _starts(activation, window, count, restarts, seed):
        result = minimize(coarse, start, jac=True, method="L-BFGS-B", options=options)
        results.append((result.fun, np.sort(result.x)))
    results.sort(key=lambda r: r[0])
    objective = _Objective(activation, window)
    best = None
    for _, start in results[:3]:
        result = minimize(objective, start, jac=True, method="L-BFGS-B", options=options)
        if best is None or result.fun < best.fun:
            best = result
    order = np.argsort(best.x)
    thresholds, weights = best.x[order], objective.solve(best.x)[1][order]
    levels = np.concatenate([[0.0], np.cumsum(weights)[:-1], [1.0]])
    return StepDerivative(tuple(float(t) for t in thresholds), tuple(float(v) for v in levels))


def objective_value(fn: str | Callable, step: StepDerivative, window: float | None = None) -> float:
    """The L2 objective ``int (h - h~)^2 dx`` of a step derivative (its ReLU weights from its levels);
    ``fn`` as for :func:`fit_step_derivative`."""
    activation = _numpy_activation("objective_value", fn)
    objective = _Objective(activation, _window(fn, activation, window))
    weights = np.diff(np.asarray(step.levels))
    approx = np.maximum(objective.x[:, None] - np.asarray(step.thresholds)[None, :], 0.0) @ weights
    residual = (objective.h - approx) * objective.w
    return float(residual @ residual)
