"""Fitting k-bit step derivatives (appendix E objective) and the shipped tables."""

from __future__ import annotations

import math

import pytest

from lightning_lowmem.ops.constants import GELU_2BIT, SILU_2BIT
from lightning_lowmem.ops.step_tables import OBJECTIVES, TABLES

pytest.importorskip("scipy")

from lightning_lowmem.approx import fit_step_derivative, objective_value

ACTIVATION_NAMES = ("gelu", "gelu_tanh", "silu", "quick_gelu", "mish")


def test_tables_are_well_formed():
    assert set(TABLES) == set(ACTIVATION_NAMES)
    for name, per_bits in TABLES.items():
        assert set(per_bits) == {1, 2, 3, 4}, name
        for bits, step in per_bits.items():
            assert len(step.thresholds) == 2**bits - 1 and len(step.levels) == 2**bits, (name, bits)
            assert list(step.thresholds) == sorted(step.thresholds), (name, bits)
            assert step.levels[0] == 0.0 and step.levels[-1] == 1.0, (name, bits)
            assert all(math.isfinite(v) for v in step.thresholds + step.levels)
        objectives = [OBJECTIVES[name][b] for b in (1, 2, 3, 4)]
        assert objectives == sorted(objectives, reverse=True), name  # more bits, closer fit


@pytest.mark.parametrize("name,paper", [("gelu", GELU_2BIT), ("silu", SILU_2BIT)])
def test_two_bit_fit_reaches_the_papers_objective_and_constants(name, paper):
    """The paper's simulated-annealing point is quasi-optimal on a flat landscape: our fit's
    objective is no worse and agrees with it to 3 significant digits; the constants agree
    within about 1% of the threshold spread (the outer thresholds and the levels to 3 digits)."""
    fitted = fit_step_derivative(name, 2)
    ours, theirs = objective_value(name, fitted), objective_value(name, paper)
    assert ours <= theirs
    assert f"{ours:.3g}" == f"{theirs:.3g}"
    spread = paper.thresholds[-1] - paper.thresholds[0]
    # the objective is symmetric under x -> -x for GELU/SiLU (h'(x) + h'(-x) = 1): compare both mirror images
    mirrored = tuple(-t for t in reversed(fitted.thresholds))
    error = min(max(abs(a - b) for a, b in zip(c, paper.thresholds)) for c in (fitted.thresholds, mirrored))
    assert error < 0.01 * spread
    mirrored_levels = tuple(1.0 - v for v in reversed(fitted.levels))
    assert (
        min(max(abs(a - b) for a, b in zip(levels, paper.levels)) for levels in (fitted.levels, mirrored_levels)) < 0.01
    )


@pytest.mark.parametrize("name", ["gelu", "silu", "mish"])
def test_quick_refit_matches_the_shipped_tables(name):
    for bits in (1, 2):
        fitted = fit_step_derivative(name, bits)
        assert objective_value(name, fitted) == pytest.approx(OBJECTIVES[name][bits], rel=1e-6)
        shipped = TABLES[name][bits]
        assert max(abs(a - b) for a, b in zip(fitted.thresholds, shipped.thresholds)) < 1e-3


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        fit_step_derivative("gelu", 5)
    with pytest.raises(ValueError, match="unknown activation"):
        fit_step_derivative("tanh", 2)
