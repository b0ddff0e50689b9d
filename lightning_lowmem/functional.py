"""Functional API: the low-memory autograd ops of :mod:`lightning_lowmem.ops`."""

from lightning_lowmem import ops
from lightning_lowmem.ops import *  # the same names, under the public module

__all__ = ops.__all__
