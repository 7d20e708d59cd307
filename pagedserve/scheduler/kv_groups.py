"""KV-cache groups: a model's layers grouped by attention type, all groups sharing one pool of blocks.

A full-attention layer needs every position's K/V; a sliding-window layer only its window's. Layers of one type
share block tables, and a sliding group lets go of the blocks its window has left (`BlockManager`). As in vLLM's
hybrid allocator, the groups hold equally many layers and share one block id space: block b is the same-size page
of every group's layers, in one tensor set [layers_per_group, 2, N, B, Hkv, D] whose tensor j holds layer j of
every group. So one free list serves every group, and a block a sliding group lets go can hold a full group's
tokens. A type whose layer count the group size does not divide gets a last, smaller group: its missing layers'
pages are padding, memory no layer uses. A model without windows has one group of all its layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # the layers' sliding window; None: full attention
    layers: tuple[int, ...]  # the model's layers in this group, in order


def group_size(counts: Sequence[int]) -> int:
    """How many layers each group holds, given each attention type's layer count: the smallest count (vLLM's rule),
    so that the smallest type is one group and no type is split finer than it; but the largest where that pads
    little (largest < 1.25 x smallest), since fewer groups cost the scheduler less per step."""
    smallest, largest = min(counts), max(counts)
    return largest if largest < 1.25 * smallest else smallest


def kv_groups(layer_windows: Sequence[int | None]) -> list[KVGroup]:
    """The groups of layers with `layer_windows` (per layer: its window, None for full attention): full
    attention first, then each window's, smallest window first; each type cut into runs of `group_size`
    consecutive layers (its last run perhaps shorter: padded)."""
    windows = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    by_type = [[i for i, lw in enumerate(layer_windows) if lw == w] for w in windows]
    if not by_type:
        return [KVGroup(None, ())]
    size = group_size([len(layers) for layers in by_type])
    return [KVGroup(w, tuple(layers[i:i + size])) for w, layers in zip(windows, by_type, strict=True)
            for i in range(0, len(layers), size)]


def layers_per_group(groups: Sequence[KVGroup]) -> int:
    """The tensors of the shared pool: the largest group's layer count."""
    return max(len(group.layers) for group in groups)


def layer_group_slots(groups: Sequence[KVGroup]) -> dict[int, tuple[int, int]]:
    """Each layer's (group, index among that group's layers): its block tables, and the pool tensor its K/V live
    in."""
    return {layer: (g, j) for g, group in enumerate(groups) for j, layer in enumerate(group.layers)}


def blocks_held_at_most(window: int | None, block_size: int, num_tokens: int, chunk: int) -> int:
    """The most blocks one sequence of `num_tokens` tokens holds at once in a group with `window`, computed in
    steps of at most `chunk` tokens: all of them without a window; else those reaching from the first key the
    step's first token sees (its position - window + 1) to the step's last token."""
    whole = -(-num_tokens // block_size)
    if window is None:
        return whole
    return min(whole, -(-(window - 1 + chunk) // block_size) + 1)
