"""Small tensor helpers for the state a worker keeps and the lists each step brings."""

from __future__ import annotations

import array

import torch

_INT64_PER_16_BYTES = 2
# array.array type codes of the dtypes that step lists become.
_ARRAY_CODES = {torch.long: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d", torch.bool: "b"}


def host_tensor(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` for a flat list of numbers, built through `array.array`: about a
    third of the time for the hundreds of entries a step brings (torch reads a list element by element)."""
    code = _ARRAY_CODES.get(dtype)
    if code is None or not values:  # frombuffer refuses an empty buffer
        return torch.tensor(values, dtype=dtype)
    return torch.frombuffer(array.array(code, values), dtype=dtype)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied without making the host wait for the device. A copy from pageable
    memory may wait for every kernel queued before it (the driver stages it through pinned memory of its
    own), which would stall a step launched while the one before it runs; so on CUDA the copy starts from
    pinned memory, whose caching allocator keeps the block until the copy has read it."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def on_device(device: torch.device, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list as a tensor on `device`, copied without waiting for the device (see `to_device`)."""
    return to_device(host_tensor(values, dtype), device)


def fill_at(t: torch.Tensor, index: tuple[torch.Tensor, ...], value: float) -> None:
    """`t[index] = value` for index tensors, without making the host wait for the device: assigned so, a
    Python number becomes a host tensor that is copied to a CUDA `t` from pageable memory (see `to_device`).
    Here the value is made on `t`'s device."""
    t.index_put_(index, t.new_full((), value))


def grown(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`t` if it covers `shape`; else zeros with `t` in its corner, each dimension that falls short at least
    doubled, so that a table grown a row at a time is copied only a logarithmic number of times."""
    if all(need <= have for need, have in zip(shape, t.shape, strict=True)):
        return t
    size = tuple(have if need <= have else max(need, 2 * have) for need, have in zip(shape, t.shape, strict=True))
    out = torch.zeros(size, dtype=t.dtype, device=t.device)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def on_device_packed(device: torch.device, segments: list[list[int] | torch.Tensor]) -> list[torch.Tensor]:
    """Host int64 segments (lists or tensors) on `device` in one copy (one launch, one pinned staging block):
    views, in order, into one buffer, each starting 16 bytes aligned. Triton compiles a kernel variant for
    each combination of its pointers' 16-byte alignment: unaligned views, where the lengths before them
    decide the alignment, would bring new variants mid-run (a second or more each)."""
    parts: list[torch.Tensor] = []
    sizes: list[int] = []  # each segment's length, then its padding
    run: list[int] = []  # neighbouring lists become one tensor: a tensor per list costs more than the copy
    for segment in segments:
        pad = -len(segment) % _INT64_PER_16_BYTES
        if isinstance(segment, torch.Tensor):
            if run:
                parts.append(host_tensor(run))
                run = []
            parts.append(segment)
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.long))
        else:
            run += segment
            run += [0] * pad
        sizes += [len(segment), pad]
    if run:
        parts.append(host_tensor(run))
    host = torch.cat(parts)  # [sum of lengths and padding]
    return list(to_device(host, device).split(sizes)[::2])
