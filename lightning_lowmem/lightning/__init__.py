"""Lightning integration: callbacks and the precision plugin."""

from lightning_lowmem.lightning.fsdp_precision import LowMemFSDPPrecision
from lightning_lowmem.lightning.lowmem_bp import LowMemBP
from lightning_lowmem.lightning.monitor import MemoryBudgetExceeded, PeakMemoryMonitor
from lightning_lowmem.lightning.precision import LowMemPrecision

__all__ = ["LowMemBP", "LowMemFSDPPrecision", "LowMemPrecision", "MemoryBudgetExceeded", "PeakMemoryMonitor"]
