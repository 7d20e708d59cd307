"""The KV pool: one allocation for all layers, sized from a memory budget."""

from __future__ import annotations

import torch

from pagedserve.workers.models.model_config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * block_size * heads * config.head_dim * itemsize


def allocate_kv_pool(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                     device: torch.device, num_kv_heads: int | None = None) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], zeroed so that padded
    reads past a sequence's end meet finite values (masked to 0 weight, never NaN * 0)."""
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return torch.zeros((config.num_layers, 2, num_blocks, block_size, heads, config.head_dim),
                       dtype=dtype, device=device)


def parse_memory(value: int | float | str) -> int:
    """Bytes from 1073741824, '1GiB', '512MiB', '2GB', '1.5G'."""
    if isinstance(value, int | float):
        return int(value)
    s = value.strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    for suffix, mult in units.items():
        if s.endswith(suffix):
            try:
                return int(float(s[: -len(suffix)]) * mult)
            except ValueError:
                break
    try:
        return int(float(s))
    except ValueError:
        raise ValueError(f"kv_cache_memory={value!r} is not a size (e.g. 2GiB, 512MiB, or bytes)") from None
