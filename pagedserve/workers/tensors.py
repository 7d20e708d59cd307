"""Small tensor helpers for the state a worker keeps and the lists each step brings."""

from __future__ import annotations

import torch


def on_device(device: torch.device, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list as a tensor on `device`, copied without waiting for the device (torch.tensor(...,
    device=cuda) waits for every kernel queued before it)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def grown(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`t` if it covers `shape`; else zeros with `t` in its corner, each dimension that falls short at least
    doubled, so that a table grown a row at a time is copied only a logarithmic number of times."""
    if all(need <= have for need, have in zip(shape, t.shape, strict=True)):
        return t
    size = tuple(have if need <= have else max(need, 2 * have) for need, have in zip(shape, t.shape, strict=True))
    out = torch.zeros(size, dtype=t.dtype, device=t.device)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out
