"""lightning-lowmem: fine-tune transformers in less activation memory.

Approximate backpropagation (ReGELU2, ReSiLU2) and memory-sharing norms (MS-LN,
MS-RMSNorm) from "Reducing Fine-Tuning Memory Overhead by Approximate and
Memory-Sharing Backpropagation" (ICML 2024).
"""

from lightning_lowmem import functional, kernels, memory, nn
from lightning_lowmem.lightning import LowMemPrecision, PeakMemoryMonitor

__version__ = "0.1.0"

__all__ = ["LowMemPrecision", "PeakMemoryMonitor", "functional", "kernels", "memory", "nn"]
