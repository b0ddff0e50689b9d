"""The dtype autocast computes in, the one question every low-memory op and module asks."""

from __future__ import annotations

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype when autocast is on for ``device_type``, else ``None`` (also for device types
    autocast does not know, such as ``meta``)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None
