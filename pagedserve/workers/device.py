"""Host lists onto the device without waiting for it."""

from __future__ import annotations

import torch


def on_device(device: torch.device, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list as a tensor on `device`, copied without waiting for the device (torch.tensor(...,
    device=cuda) waits for every kernel queued before it)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
