"""Modules over the low-memory ops."""

from lightning_lowmem.nn.activation import ReGELU2, ReSiLU2
from lightning_lowmem.nn.gated import GatedMLP
from lightning_lowmem.nn.norm import MSLayerNorm, MSRMSNorm

__all__ = ["GatedMLP", "MSLayerNorm", "MSRMSNorm", "ReGELU2", "ReSiLU2"]
