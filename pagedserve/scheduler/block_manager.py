"""Which blocks each sequence owns: prefix-cache hits, slot allocation, copy-on-write, fork."""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import xxhash

from pagedserve.scheduler.block_pool import BlockPool
from pagedserve.scheduler.request import Sequence

_ROOT = b"pagedserve-root\x00"  # stands in for the parent hash of a sequence's first block


def hash_block(parent_hash: int | None, token_ids: Seq[int]) -> int:
    """Chained xxh64: a block's hash covers every token before it, not just its own."""
    prefix = _ROOT if parent_hash is None else parent_hash.to_bytes(8, "little")
    return xxhash.xxh64_intdigest(prefix + array("q", token_ids).tobytes())


def chain_root(cache_salt: str | None, long_rope: bool = False) -> int | None:
    """The parent of a sequence's first block: None, or one derived from the request's `cache_salt`. A salted
    prompt's blocks then hash (and are found) only under the same salt, so requests of other tenants can
    neither reuse them nor tell from their speed that a prompt was seen. `long_rope`: a sequence whose K/V are
    computed under LongRoPE's long factors (a `Sequence`'s `rope_long`), other K/V than the same tokens' under the
    short ones, so filed apart from them."""
    root = None if cache_salt is None else xxhash.xxh64_intdigest(b"pagedserve-salt\x00" + cache_salt.encode())
    if long_rope:
        salt = b"" if root is None else root.to_bytes(8, "little")
        root = xxhash.xxh64_intdigest(b"pagedserve-long-rope\x00" + salt)
    return root


def _root(seq: Sequence) -> int | None:
    return chain_root(seq.request.params.cache_salt, seq.rope_long)


def prefix_hashes(token_ids: Seq[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """The chained hashes of every full block of `token_ids`, as the prefix cache files them."""
    hashes: list[int] = []
    parent = chain_root(cache_salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class CachedPrefix:
    """What the prefix cache holds of a sequence's tokens (`BlockManager.get_computed_blocks`): whole blocks,
    shared as they are, then perhaps the first tokens of the next block, copied from a block that holds them
    (a tail: the partial last block of a sequence that has let it go)."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    tail: tuple[int, int] | None = None  # (block id, its tokens taken)
    block_size: int = 1

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size + (self.tail[1] if self.tail else 0)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    def reset(self) -> None:
        """Forget every block and cached prefix (the workers' pools were rebuilt empty). No sequence may
        hold blocks; the prefix-cache counters keep counting."""
        if self.pool.num_free_blocks != self.pool.num_blocks:
            raise RuntimeError(f"reset with {self.pool.num_blocks - self.pool.num_free_blocks} KV blocks still held")
        self.pool = BlockPool(self.pool.num_blocks)

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> CachedPrefix:
        """Longest cached prefix of a sequence that holds no blocks, without taking it: whole cached blocks,
        then the longest tail that goes on from them.

        Stops before the last token: that token must be computed for its logits (and a full cached block is
        never written again, so the block holding it is never shared whole).
        """
        cached = CachedPrefix(block_size=self.block_size)
        if not self.enable_prefix_caching:
            return cached
        bs = self.block_size
        parent = _root(seq)
        for i in range((seq.num_tokens - 1) // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = hash_block(parent, tokens)
            block_id = self.pool.lookup(h, parent, tokens)
            if block_id is None:
                break
            cached.blocks.append(block_id)
            cached.hashes.append(h)
            parent = h
        start = len(cached.blocks) * bs
        cached.tail = self.pool.lookup_tail(parent, seq.token_ids[start:min(start + bs - 1, seq.num_tokens - 1)])
        return cached

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       cached: CachedPrefix | None = None) -> list[tuple[int, int]] | None:
        """Make the block table cover `num_new_tokens` more tokens.

        The `cached` prefix (from `get_computed_blocks`) is attached first: its whole blocks shared, its tail
        copied into a block of the sequence's own. Returns the (src, dst) block copies the worker must do
        before writing, or None when the pool is short, in which case nothing changed.
        """
        cached = cached or CachedPrefix(block_size=self.block_size)
        computed_blocks, tail = cached.blocks, cached.tail
        bs = self.block_size
        num_computed = seq.num_computed_tokens + cached.num_tokens
        table_len = len(seq.block_table) + len(computed_blocks)
        needed = self.blocks_for(num_computed + num_new_tokens) - table_len  # the tail's copy among them
        # The block the first new token lands in is shared after a fork: copy it first.
        write_idx = num_computed // bs
        cow = write_idx < len(seq.block_table) and self.pool.ref_count(seq.block_table[write_idx]) > 1
        if needed <= 0 and not cow and not computed_blocks and tail is None:
            return []  # most decode steps: the tokens fit the last block, which is the sequence's own
        revived = sum(1 for b in computed_blocks if self.pool.ref_count(b) == 0)
        # A free tail block is held while its copy is allocated (so that the copy is not the block itself).
        held = tail is not None and tail[0] not in computed_blocks and self.pool.ref_count(tail[0]) == 0
        if max(needed, 0) + cow > self.pool.num_free_blocks - revived - held:
            return None

        if seq.block_table == [] and seq.num_computed_tokens == 0 and self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += cached.num_tokens
        if computed_blocks:
            self.pool.touch(computed_blocks)
            seq.block_table.extend(computed_blocks)
            seq.block_hashes.extend(cached.hashes)
        seq.num_computed_tokens = num_computed
        copies = []
        if tail is not None:
            src = tail[0]
            self.pool.touch([src])
            dst = self.pool.allocate().block_id
            self.pool.free([src])
            seq.block_table.append(dst)
            copies.append((src, dst))
            needed -= 1
        if cow:
            src = seq.block_table[write_idx]
            dst = self.pool.allocate().block_id
            self.pool.free([src])
            seq.block_table[write_idx] = dst
            seq.num_sent_blocks = min(seq.num_sent_blocks, write_idx)
            copies.append((src, dst))
        for _ in range(needed):
            seq.block_table.append(self.pool.allocate().block_id)
        return copies

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register blocks that became full and computed. A block whose last token is still pending (a
        step scheduled ahead computes it) waits: its hash needs that token."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), min(seq.num_computed_tokens, seq.num_tokens) // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else _root(seq)
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = hash_block(parent, tokens)
            if self.enable_prefix_caching:
                self.pool.cache(seq.block_table[i], h, parent, tokens)
            seq.block_hashes.append(h)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; writes copy on demand."""
        self.pool.touch(parent.block_table)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.rope_long = parent.rope_long
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks; tail blocks first so they are evicted first. A partial last block's
        computed tokens stay findable (`BlockPool.cache_tail`) until the block is allocated again: a
        sequence that goes on from them (a beam search's next step, a preempted sequence readmitted, the
        next turn of a chat) copies the block instead of computing them."""
        computed = min(seq.num_computed_tokens, seq.num_tokens)  # a pending token's K/V is not written yet
        full, partial = divmod(computed, self.block_size)
        if (self.enable_prefix_caching and partial and full < len(seq.block_table)
                and len(seq.block_hashes) >= full):
            parent = seq.block_hashes[full - 1] if full else _root(seq)
            start = full * self.block_size
            self.pool.cache_tail(seq.block_table[full], parent, seq.token_ids[start:start + partial])
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.num_sent_blocks = 0
