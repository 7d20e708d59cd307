"""The KV pools: one allocation per KV-cache group (`scheduler/kv_groups.py`) for its layers, sized from a memory
budget."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.scheduler.kv_groups import KVGroup, blocks_held_at_most, kv_groups
from pagedserve.workers.models.model_config import ModelConfig


def model_kv_groups(config: ModelConfig) -> list[KVGroup]:
    return kv_groups(config.layer_windows)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None,
                    num_layers: int | None = None) -> int:
    """A block's bytes over `num_layers` layers (all of the model's by default)."""
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    layers = config.num_layers if num_layers is None else num_layers
    itemsize = torch.empty((), dtype=dtype).element_size()
    return layers * 2 * block_size * heads * config.head_dim * itemsize


def split_kv_budget(budget: int, groups: Sequence[KVGroup], group_block_bytes: Sequence[int], block_size: int,
                    max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """How many blocks each group's pool gets from `budget` bytes (a group's block costs `group_block_bytes`).

    Without windows every group would hold the same positions, so each would get the same count, E. A sliding
    group gets no more than E, and no more than the most its sequences can hold at once: `max_num_seqs`
    sequences each holding a window's span, plus a step's worth of new tokens and its reserved placeholder
    block. What that leaves goes to the full-attention groups, whose blocks hold whole contexts: the longer
    the contexts, the more they gain. A model of sliding groups only gives them all of it (more sequences, a
    larger prefix cache)."""
    equal = budget // sum(group_block_bytes) if group_block_bytes else 0
    full = [g for g, group in enumerate(groups) if group.window is None]
    if not full:
        return [equal] * len(groups)
    counts = [0] * len(groups)
    left = budget
    for g, group in enumerate(groups):
        if group.window is not None:
            most = (max_num_seqs * (blocks_held_at_most(group.window, block_size, 1 << 62, 1) + 1)
                    + -(-max_num_batched_tokens // block_size) + 1)
            counts[g] = min(equal, most)
            left -= counts[g] * group_block_bytes[g]
    full_bytes = sum(group_block_bytes[g] for g in full)
    for g in full:
        counts[g] = left // full_bytes
    return counts


def allocate_kv_pools(config: ModelConfig, num_blocks: Sequence[int], block_size: int, dtype: torch.dtype,
                      device: torch.device, num_kv_heads: int | None = None) -> list[torch.Tensor]:
    """Per KV-cache group, [its layers, 2, its num_blocks, block_size, num_kv_heads, head_dim], zeroed so that
    padded reads past a sequence's end meet finite values (masked to 0 weight, never NaN * 0)."""
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    groups = model_kv_groups(config)
    if len(num_blocks) != len(groups):
        raise ValueError(f"num_blocks={list(num_blocks)} has a count for {len(num_blocks)} KV-cache groups, the "
                         f"model has {len(groups)}")
    return [torch.zeros((len(group.layers), 2, n, block_size, heads, config.head_dim), dtype=dtype, device=device)
            for group, n in zip(groups, num_blocks, strict=True)]


def layer_caches(config: ModelConfig, pools: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each layer's [2, N, B, Hkv, D] view of its group's pool, in layer order."""
    caches: list[torch.Tensor | None] = [None] * config.num_layers
    for group, pool in zip(model_kv_groups(config), pools, strict=True):
        for j, layer in enumerate(group.layers):
            caches[layer] = pool[j]
    return caches


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
