"""Fitting k-bit step derivatives for any activation (paper, section 4.2 and appendix E).

Needs scipy (only for fitting; the shipped tables in :mod:`lightning_lowmem.registry.step_tables`
are plain constants). Regenerate them with ``python -m lightning_lowmem.approx --write``.
"""

from lightning_lowmem.approx.fit import fit_step_derivative, objective_value

__all__ = ["fit_step_derivative", "objective_value"]
