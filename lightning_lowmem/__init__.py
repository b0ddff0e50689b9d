"""lightning-lowmem: fine-tune transformers in less activation memory.

Approximate backpropagation (ReGELU2, ReSiLU2) and memory-sharing norms (MS-LN,
MS-RMSNorm) from "Reducing Fine-Tuning Memory Overhead by Approximate and
Memory-Sharing Backpropagation" (ICML 2024).
"""

from lightning_lowmem import functional, kernels, memory, nn, registry
from lightning_lowmem.lightning import LowMemBP, LowMemFSDPPrecision, LowMemPrecision, PeakMemoryMonitor
from lightning_lowmem.registry import register_activation, register_norm
from lightning_lowmem.surgery import LowMemReport, Options, apply_lowmem, max_batch_size, plan
from lightning_lowmem.surgery.apply import max_sequence_length, training_memory
from lightning_lowmem.surgery.training_memory import TrainingMemory

__version__ = "0.1.0"

__all__ = [
    "LowMemBP",
    "LowMemFSDPPrecision",
    "LowMemPrecision",
    "LowMemReport",
    "Options",
    "PeakMemoryMonitor",
    "TrainingMemory",
    "apply_lowmem",
    "functional",
    "kernels",
    "max_batch_size",
    "max_sequence_length",
    "memory",
    "nn",
    "plan",
    "register_activation",
    "register_norm",
    "registry",
    "training_memory",
]
