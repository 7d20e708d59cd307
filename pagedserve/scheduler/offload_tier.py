"""The prefix cache's second tier: full blocks evicted from the KV pool, kept by (group, hash) in `num_slots` slots
of the workers' host memory or a file on local disk (`workers/offload_store.py`), and copied back into the pool on
a hit instead of recomputed.

This is the tier's index, plain data on the scheduler's side; each step carries the copies it asks of the workers
(`StepBatch.kv_saves`, `kv_loads`), which they do before anything else in the step, saves before loads. The tier
holds a block's K/V alongside the pool (a block restored keeps its slot, so evicting it again copies nothing), LRU
over the slots."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagedserve.scheduler.block_pool import Block


@dataclass(frozen=True)
class TierEntry:
    group: int
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


class OffloadTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the KV offload tier holds {num_slots} blocks: it needs at least one")
        self.num_slots = num_slots
        self._forget()
        self.saved_blocks = 0
        self.restored_blocks = 0
        self.dropped_blocks = 0  # evicted from the pool while every slot was loading: not kept

    def _forget(self) -> None:
        num_slots = self.num_slots
        self._index: OrderedDict[tuple[int, int], int] = OrderedDict()  # (group, hash) -> slot, least recent first
        self._entries: list[TierEntry | None] = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # the lowest slot first
        # Slots the next step loads from: none is overwritten before that step ran (a save of the same step would
        # run before the load). Freed for saves once the step is sent, since the workers run steps in order.
        self._loading: set[int] = set()
        self._saves: dict[int, tuple[int, int]] = {}  # slot -> (block, hash): the next step's, one per slot
        self._loads: list[tuple[int, int, int]] = []  # (slot, block, hash)

    @property
    def num_used_slots(self) -> int:
        return len(self._index)

    def cached_hashes(self, group: int = 0) -> list[int]:
        """The hash of every block of `group` the tier holds."""
        return [h for g, h in self._index if g == group]

    def keep(self, block: Block) -> None:
        """A full, cached block about to be evicted from the pool (its K/V are intact until the step that took it
        runs): the tier keeps them, in a free slot or the least recently used one. A block it already holds (one
        restored from it) copies nothing."""
        key = (block.group, block.block_hash)
        if key in self._index:
            self._index.move_to_end(key)
            return
        slot = self._take_slot()
        if slot is None:
            self.dropped_blocks += 1
            return
        self._entries[slot] = TierEntry(block.group, block.block_hash, block.parent_hash, block.token_ids)
        self._index[key] = slot
        self._saves[slot] = (block.block_id, block.block_hash)
        self.saved_blocks += 1

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for key, slot in self._index.items():  # least recent first; rarely past the first
            if slot not in self._loading:
                del self._index[key]
                self._saves.pop(slot, None)  # a save the step had not done yet: the slot's next holder replaces it
                return slot
        return None

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int], group: int = 0) -> int | None:
        """The slot holding exactly these tokens after this parent in `group`, or None (the hash finds a
        candidate; parent and tokens rule out a collision)."""
        slot = self._index.get((group, block_hash))
        if slot is None:
            return None
        entry = self._entries[slot]
        return slot if entry.parent_hash == parent_hash and entry.token_ids == tuple(token_ids) else None

    def hold(self, slots: Iterable[int]) -> None:
        """Slots a prefix is about to restore: none of them is given to a block the restoring evicts."""
        for slot in slots:
            entry = self._entries[slot]
            self._index.move_to_end((entry.group, entry.block_hash))
            self._loading.add(slot)

    def restore(self, slot: int, block_id: int) -> TierEntry:
        """Copy the slot (held) into `block_id` in the next step, before its forward; the slot stays the block's."""
        entry = self._entries[slot]
        self._loads.append((slot, block_id, entry.block_hash))
        self.restored_blocks += 1
        return entry

    def take_copies(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """The next step's copies: saves (block, slot, hash), then loads (slot, block, hash)."""
        saves = [(block, slot, h) for slot, (block, h) in self._saves.items()]
        # A block restored twice before a step (restored, let go and restored again) holds the later one.
        loads = list({block: (slot, block, h) for slot, block, h in self._loads}.values())
        self._loads, self._saves = [], {}
        self._loading = set()
        return saves, loads

    def reset(self) -> None:
        """Forget every slot (the workers' tier was made anew, or a failed step may have written any of it); the
        counters keep counting."""
        self._forget()

    def check_invariants(self) -> None:
        """Assert the index is consistent (used by tests)."""
        assert len(self._index) + len(self._free) == self.num_slots, "slots lost or counted twice"
        assert not set(self._index.values()) & set(self._free), "a slot both free and holding a block"
        for (group, h), slot in self._index.items():
            entry = self._entries[slot]
            assert entry is not None and (entry.group, entry.block_hash) == (group, h)
