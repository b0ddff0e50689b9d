"""The dtype autocast computes in, the one question every low-memory op and module asks."""

from __future__ import annotations

import torch


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype when autocast is on for ``x``'s device type, else ``None`` (also for device types
    autocast does not know, such as ``meta``)."""
    # asked on every call of a low-memory op: where autocast is off everywhere (the common case) one C call
    # answers, with no device object made (with cold caches the norm's output_dtype took 5 us, against 10)
    if not torch._C._is_any_autocast_enabled():
        return None
    device_type = x.device.type
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None
