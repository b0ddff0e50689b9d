"""The dtype autocast computes in, the one question every low-memory op and module asks."""

from __future__ import annotations

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype when autocast is on for ``device_type``, else ``None`` (also for device types
    autocast does not know, such as ``meta``)."""
    try:  # asked on every call of a low-memory op: one question to autocast where the answer is "off"
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None
