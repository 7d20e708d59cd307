"""The KV pool: one allocation that every KV-cache group (`scheduler/kv_groups.py`) shares, sized from a memory
budget."""

from __future__ import annotations

import torch

from pagedserve.scheduler.kv_groups import KVGroup, kv_groups, layer_group_slots, layers_per_group
from pagedserve.workers.models.model_config import ModelConfig


def model_kv_groups(config: ModelConfig) -> list[KVGroup]:
    return kv_groups(config.layer_windows)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None,
                    num_layers: int | None = None) -> int:
    """A block's bytes over `num_layers` layers (the shared pool's, `layers_in_pool`, by default)."""
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    layers = layers_in_pool(config) if num_layers is None else num_layers
    itemsize = torch.empty((), dtype=dtype).element_size()
    return layers * 2 * block_size * heads * config.head_dim * itemsize


def layers_in_pool(config: ModelConfig) -> int:
    """The shared pool's layer tensors: as many as the largest KV-cache group's layers (`kv_groups.py`)."""
    return layers_per_group(model_kv_groups(config))


def allocate_kv_pool(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                     device: torch.device, num_kv_heads: int | None = None) -> torch.Tensor:
    """The pool every KV-cache group shares: [layers_per_group, 2, num_blocks, block_size, num_kv_heads, head_dim],
    tensor j holding layer j of every group (block b is the same page in each); zeroed so that padded reads past a
    sequence's end meet finite values (masked to 0 weight, never NaN * 0)."""
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return torch.zeros((layers_in_pool(config), 2, num_blocks, block_size, heads, config.head_dim), dtype=dtype,
                       device=device)


def layer_caches(config: ModelConfig, pool: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's [2, N, B, Hkv, D] view of the shared pool, in layer order: layer j of its group reads and
    writes tensor j, through its group's block tables."""
    slots = layer_group_slots(model_kv_groups(config))
    return [pool[slots[layer][1]] for layer in range(config.num_layers)]


def parse_memory(value: int | float | str, name: str = "kv_cache_memory") -> int:
    """Bytes from 1073741824, '1GiB', '512MiB', '2GB', '1.5G'; a ValueError naming the setting `name` else."""
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
        raise ValueError(f"{name}={value!r} is not a size (e.g. 2GiB, 512MiB, or bytes)") from None
