"""lightning-lowmem: fine-tune transformers in less activation memory.

Approximate backpropagation (ReGELU2, ReSiLU2) and memory-sharing norms (MS-LN,
MS-RMSNorm) from "Reducing Fine-Tuning Memory Overhead by Approximate and
Memory-Sharing Backpropagation" (ICML 2024).
"""

from lightning_lowmem import functional, kernels, memory, nn

__version__ = "0.1.0"

__all__ = ["functional", "kernels", "memory", "nn"]
