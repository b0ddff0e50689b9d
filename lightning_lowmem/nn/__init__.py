"""Modules over the low-memory ops: what model surgery installs, and what users can build by hand."""

from lightning_lowmem.nn.activation import LowMemActivation, ReGELU2, ReSiLU2
from lightning_lowmem.nn.dropout import SeededDropout
from lightning_lowmem.nn.gated import GatedMLP, GatedMLPBase, PackedGatedMLP, T5GatedMLP, TimmGluMlp
from lightning_lowmem.nn.linear import LowMemLinear, LowMemTransposedLinear
from lightning_lowmem.nn.norm import MemorySharingNorm, MSLayerNorm, MSRMSNorm

__all__ = [
    "GatedMLP",
    "GatedMLPBase",
    "LowMemActivation",
    "LowMemLinear",
    "LowMemTransposedLinear",
    "MSLayerNorm",
    "MSRMSNorm",
    "MemorySharingNorm",
    "PackedGatedMLP",
    "ReGELU2",
    "ReSiLU2",
    "SeededDropout",
    "T5GatedMLP",
    "TimmGluMlp",
]
