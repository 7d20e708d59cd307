"""The pool of KV blocks: ref counts, the prefix-cache hash table and the LRU free queue.

This is mechanism only; `BlockManager` decides which blocks a sequence gets. Every KV-cache group draws from the
one pool (`kv_groups.py`), so its cache is keyed by (group, hash): the same tokens have other K/V in another
group's layers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and its K/V are computed; kept after the block is
    # freed so a later request with the same prefix can revive it.
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    group: int = 0  # the KV-cache group whose K/V the cached block (or tail) holds
    # A partial block's computed tokens, kept when the sequence that wrote them lets it go (`cache_tail`); valid
    # until the block is allocated again. None while it is no tail.
    tail: tuple[int | None, tuple[int, ...]] | None = None


class BlockPool:
    """Fixed set of `num_blocks` blocks. All operations are O(1) per block.

    The first `reserved` blocks are never handed out nor referenced: with sliding-window groups, block 0 is the
    placeholder their block tables hold where the window has let a block go (`BlockManager`)."""

    def __init__(self, num_blocks: int, reserved: int = 0, on_evict: Callable[[Block], None] | None = None) -> None:
        if num_blocks - reserved < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= {reserved + 1}"
                             + (f" ({reserved} reserved)" if reserved else ""))
        self.num_blocks = num_blocks
        self.reserved = reserved
        # Told of each cached block as allocation evicts it, while it still holds its hash and K/V (the
        # second tier keeps them: `offload_tier.py`).
        self.on_evict = on_evict
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks, least recently freed first. An OrderedDict gives O(1)
        # removal from the middle when a cached free block is hit.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(reserved, num_blocks))
        self._cached: dict[tuple[int, int], int] = {}  # (group, block hash) -> block id
        # (group, parent hash, its tokens) -> block id
        self._tails: dict[tuple[int, int | None, tuple[int, ...]], int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        """The blocks sequences can hold: all but the reserved ones."""
        return self.num_blocks - self.reserved

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self, group: int = 0) -> list[int]:
        """The hash of every block of `group` the prefix cache can still hand out (referenced or free)."""
        return [h for g, h in self._cached if g == group]

    def allocate(self) -> Block:
        """Take the least recently freed block; evict its cached hash only now."""
        if not self._free:
            raise RuntimeError("no free KV blocks")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        self._evict(block)
        block.ref_count = 1
        return block

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (prefix-cache hit or fork); revives free ones."""
        for block_id in block_ids:
            block = self._get(block_id)
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; unreferenced ones join the free queue's tail."""
        for block_id in block_ids:
            block = self._get(block_id)
            if block.ref_count <= 0:
                raise ValueError(f"double free of KV block {block_id} (ref count is already 0)")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
               group: int = 0) -> int | None:
        """Cached block of `group` holding exactly these tokens after this parent, or None.

        The hash only finds a candidate; comparing tokens and parent rules out collisions.
        """
        block_id = self._cached.get((group, block_hash))
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block_id

    def cache(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
              group: int = 0) -> None:
        """Register a full, computed block of `group` under its hash (first writer wins on duplicates)."""
        block = self._get(block_id)
        if block.block_hash is not None or (group, block_hash) in self._cached:
            return
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        block.group = group
        self._cached[group, block_hash] = block_id

    def cache_tail(self, block_id: int, parent_hash: int | None, token_ids: Sequence[int], group: int = 0) -> None:
        """Register the first tokens of a partial block, computed after the full block `parent_hash` (or at a
        chain's root): a later sequence with the same tokens there copies the block instead of computing them.
        First writer wins on duplicates; a block holds one tail, its latest."""
        key = (group, parent_hash, tuple(token_ids))
        if key in self._tails:
            return
        block = self._get(block_id)
        if block.tail is not None:
            del self._tails[block.tail]
        block.tail = key
        self._tails[key] = block_id

    def lookup_tail(self, parent_hash: int | None, token_ids: Sequence[int],
                    group: int = 0) -> tuple[int, int] | None:
        """The block of `group` whose tail after `parent_hash` is the longest prefix of `token_ids`, and that
        prefix's length; None when no tail is. One dict lookup per length: no scan of the tails."""
        for n in range(len(token_ids), 0, -1):
            block_id = self._tails.get((group, parent_hash, tuple(token_ids[:n])))
            if block_id is not None:
                return block_id, n
        return None

    def ref_count(self, block_id: int) -> int:
        return self._get(block_id).ref_count

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.on_evict is not None:
                self.on_evict(block)
            del self._cached[block.group, block.block_hash]
            block.block_hash = None
            block.parent_hash = None
            block.token_ids = ()
        if block.tail is not None:
            del self._tails[block.tail]
            block.tail = None

    def _get(self, block_id: int) -> Block:
        if not isinstance(block_id, int) or not self.reserved <= block_id < self.num_blocks:
            raise ValueError(f"KV block id {block_id!r} is out of range [{self.reserved}, {self.num_blocks})")
        return self.blocks[block_id]

    def check_invariants(self) -> None:
        """Assert the pool's bookkeeping is consistent (used by tests)."""
        free = set(self._free)
        assert len(free) == len(self._free)
        used = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert all(b.ref_count >= 0 for b in self.blocks), "negative ref count"
        assert not (free & used), "block both free and referenced"
        assert len(free) + len(used) == self.num_usable_blocks, "free + used != total"
        assert all(b.ref_count == 0 and b.block_hash is None and b.tail is None
                   for b in self.blocks[:self.reserved]), "a reserved block was used"
        for (g, h), block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == h and self.blocks[block_id].group == g
        for key, block_id in self._tails.items():
            assert self.blocks[block_id].tail == key and 0 < len(key[2])
