"""KV-cache groups: a model's layers grouped by attention type, each group with its own blocks.

A full-attention layer needs every position's K/V; a sliding-window layer only its window's. Layers of one type
share block tables, so each group has its own block id space, pool and per-sequence table, and a sliding group
lets go of the blocks its window has left (`BlockManager`). A model without windows has one group: everything is
as it was without groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # the layers' sliding window; None: full attention
    layers: tuple[int, ...]  # the model's layers in this group, in order


def kv_groups(layer_windows: Sequence[int | None]) -> list[KVGroup]:
    """The groups of layers with `layer_windows` (per layer: its window, None for full attention): full
    attention first, then one group per window, smallest first."""
    windows = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    return [KVGroup(w, tuple(i for i, lw in enumerate(layer_windows) if lw == w)) for w in windows] or [
        KVGroup(None, ())]


def layer_group_slots(groups: Sequence[KVGroup]) -> dict[int, tuple[int, int]]:
    """Each layer's (group, index among that group's layers): where its K/V live in the group's pool."""
    return {layer: (g, j) for g, group in enumerate(groups) for j, layer in enumerate(group.layers)}


def blocks_held_at_most(window: int | None, block_size: int, num_tokens: int, chunk: int) -> int:
    """The most blocks one sequence of `num_tokens` tokens holds at once in a group with `window`, computed in
    steps of at most `chunk` tokens: all of them without a window; else those reaching from the first key the
    step's first token sees (its position - window + 1) to the step's last token."""
    whole = -(-num_tokens // block_size)
    if window is None:
        return whole
    return min(whole, -(-(window - 1 + chunk) // block_size) + 1)
