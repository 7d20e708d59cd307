"""Which blocks each sequence owns: prefix-cache hits, slot allocation, copy-on-write, fork.

One block table per sequence for each KV-cache group (`kv_groups.py`), all groups drawing from one shared pool: a
model without windows has one group. A sliding-window group lets go of a sequence's blocks that lie wholly before
the window of the next token it computes, and its table holds `NULL_BLOCK` there; any group may take that block
next."""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import xxhash

from pagedserve.scheduler.block_pool import BlockPool
from pagedserve.scheduler.kv_groups import blocks_held_at_most
from pagedserve.scheduler.offload_tier import OffloadTier
from pagedserve.scheduler.prefix_transfer import ExportOrder, PrefixImport
from pagedserve.scheduler.request import Sequence

_ROOT = b"pagedserve-root\x00"  # stands in for the parent hash of a sequence's first block
# The pool's reserved block where any group slides: what a sliding group's tables hold where the window has let a
# block go. Never allocated; a kernel may read it (masked) in a tile that starts before the window, so it must be a
# valid id.
NULL_BLOCK = 0
# A cached prefix's entry for a block the second tier holds (`CachedPrefix.restores`): allocated and copied back
# when the prefix is taken.
TO_RESTORE = -1
_IMPORTED = -(1 << 62)  # a lookup's hit on a page another replica's export staged here (`PrefixImport`)
UNBOUNDED = 1 << 62  # a sequence length no pool limits


def hash_block(parent_hash: int | None, token_ids: Seq[int]) -> int:
    """Chained xxh64: a block's hash covers every token before it, not just its own."""
    prefix = _ROOT if parent_hash is None else parent_hash.to_bytes(8, "little")
    return xxhash.xxh64_intdigest(prefix + array("q", token_ids).tobytes())


def chain_root(cache_salt: str | None, long_rope: bool = False, adapter: int | None = None) -> int | None:
    """The parent of a sequence's first block: None, or one derived from the request's `cache_salt`. A salted
    prompt's blocks then hash (and are found) only under the same salt, so requests of other tenants can
    neither reuse them nor tell from their speed that a prompt was seen. `long_rope`: a sequence whose K/V are
    computed under LongRoPE's long factors (a `Sequence`'s `rope_long`), other K/V than the same tokens' under the
    short ones, so filed apart from them. `adapter`: the LoRA adapter's id (`lora_int_id`) the K/V are computed
    under: the same tokens' K/V under another adapter, or the base model, are others."""
    root = None if cache_salt is None else xxhash.xxh64_intdigest(b"pagedserve-salt\x00" + cache_salt.encode())
    if long_rope:
        root = _derived(b"pagedserve-long-rope\x00", root)
    if adapter is not None:
        root = _derived(b"pagedserve-lora\x00" + adapter.to_bytes(8, "little"), root)
    return root


def _derived(tag: bytes, root: int | None) -> int:
    return xxhash.xxh64_intdigest(tag + (b"" if root is None else root.to_bytes(8, "little")))


def _root(seq: Sequence) -> int | None:
    lora = seq.request.lora
    return chain_root(seq.request.params.cache_salt, seq.rope_long, None if lora is None else lora.lora_int_id)


def prefix_hashes(token_ids: Seq[int], block_size: int, cache_salt: str | None = None,
                  adapter: int | None = None) -> list[int]:
    """The chained hashes of every full block of `token_ids`, as the prefix cache files them (`adapter`: the LoRA
    adapter's id)."""
    hashes: list[int] = []
    parent = chain_root(cache_salt, adapter=adapter)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class CachedPrefix:
    """What the prefix cache holds of a sequence's tokens (`BlockManager.get_computed_blocks`): whole blocks,
    shared as they are, then perhaps the first tokens of the next block, copied from a block that holds them
    (a tail: the partial last block of a sequence that has let it go). Per KV-cache group: its blocks (a
    sliding-window group's hold `NULL_BLOCK` before the window of the first token to compute) and its tail's (one
    block id space for all groups)."""

    blocks: list[list[int]]  # [groups][whole blocks]
    hashes: list[int] = field(default_factory=list)
    tail: tuple[list[int], int] | None = None  # (each group's block id, its tokens taken)
    block_size: int = 1
    # [groups] {index into blocks: the second tier's slot}: blocks evicted from the pool that the tier holds
    # (`TO_RESTORE` in `blocks`), copied back into blocks of their own when the prefix is taken
    restores: list[dict[int, int]] = field(default_factory=list)
    # {index into blocks: the staged page}: blocks fetched from another replica (`TO_RESTORE` in `blocks`; a model
    # of one KV-cache group), copied into blocks of their own when the prefix is taken
    imports: dict[int, int] = field(default_factory=dict)
    import_id: int | None = None

    def __post_init__(self) -> None:
        self.restores = self.restores or [{} for _ in self.blocks]

    @property
    def num_restored_tokens(self) -> int:
        """The tokens of the blocks some group restores from the second tier."""
        return len(set().union(*self.restores)) * self.block_size

    @property
    def num_imported_tokens(self) -> int:
        """The tokens of the blocks fetched from another replica."""
        return len(self.imports) * self.block_size

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.block_size + (self.tail[1] if self.tail else 0)


class BlockManager:
    """`num_blocks` shared by the KV-cache groups, whose sliding `windows` (one per group; None: full attention)
    say which blocks a sequence needs. Every group's tables draw from the one pool, so a block one group lets go
    serves any other."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Seq[int | None] = (None,), offload_blocks: int = 0) -> None:
        """`offload_blocks`: the second tier's slots (`offload_tier.py`), 0 for none."""
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        if not isinstance(num_blocks, int):
            raise ValueError(f"num_blocks={num_blocks!r} must be one int: the groups share one pool")
        if offload_blocks and not enable_prefix_caching:
            raise ValueError("a KV offload tier keeps the prefix cache's blocks: it needs enable_prefix_caching")
        self.windows = tuple(windows)
        self.tier = OffloadTier(offload_blocks) if offload_blocks else None
        self.pool = self._new_pool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found, in the pool or the second tier
        self.offload_hits = 0  # tokens found in the second tier
        self.transfer_hits = 0  # tokens fetched from another replica
        self._imports: list[tuple[int, int, int]] = []  # (import id, page, block): the next step's copies

    def _new_pool(self, num_blocks: int) -> BlockPool:
        sliding = any(w is not None for w in self.windows)
        return BlockPool(num_blocks, reserved=1 if sliding else 0,  # NULL_BLOCK where a group slides
                         on_evict=self.tier.keep if self.tier else None)

    def reset(self) -> None:
        """Forget every block and cached prefix (the workers' pools were rebuilt empty). No sequence may
        hold blocks; the prefix-cache counters keep counting."""
        if self.num_free_blocks != self.num_total_blocks:
            raise RuntimeError(f"reset with {self.num_total_blocks - self.num_free_blocks} KV blocks still held")
        self.pool = self._new_pool(self.pool.num_blocks)
        self._imports = []
        if self.tier is not None:
            self.tier.reset()

    def take_offload_copies(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """The copies the next step does first (`StepBatch.kv_saves`, `kv_loads`): blocks into the second tier,
        then blocks out of it."""
        return self.tier.take_copies() if self.tier is not None else ([], [])

    def take_imports(self) -> list[tuple[int, int, int]]:
        """The next step's copies from pages staged by imports (`StepBatch.kv_imports`): (import id, page, block)."""
        imports, self._imports = self._imports, []
        return imports

    def export_blocks(self, order: ExportOrder) -> tuple[list[int], list[int]]:
        """The chained hashes and the blocks (-1 - the second tier's slot where it holds one) of `order`'s cached full
        blocks, as many in a row from its first as the pool or the tier holds. Nothing for a model of several KV-cache
        groups (a sliding window's blocks are not exported)."""
        hashes: list[int] = []
        blocks: list[int] = []
        if not self.enable_prefix_caching or self.num_groups != 1:
            return hashes, blocks
        bs, parent = self.block_size, order.root
        for i in range(min(len(order.token_ids) // bs, order.first_block + order.num_blocks)):
            tokens = order.token_ids[i * bs:(i + 1) * bs]
            h = hash_block(parent, tokens)
            if i >= order.first_block:
                hit = self._lookup(h, parent, tokens, 0)
                if hit is None:
                    break
                hashes.append(h)
                blocks.append(hit)
            parent = h
        return hashes, blocks

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed_alone(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence of `num_tokens` tokens holds at once over all groups, computed in steps of
        at most `chunk` tokens."""
        return sum(blocks_held_at_most(w, self.block_size, num_tokens, chunk) for w in self.windows)

    def max_seq_len(self, chunk: int) -> int:
        """The longest sequence that fits the pool on its own, computed in steps of at most `chunk` tokens
        (`UNBOUNDED` where only windowed groups hold it and their window spans fit together)."""
        usable, bs = self.pool.num_usable_blocks, self.block_size
        if None in self.windows and len(set(self.windows)) == 1:  # no windows: every group holds every position
            return usable // self.num_groups * bs
        if self.blocks_needed_alone(UNBOUNDED, chunk) <= usable:
            return UNBOUNDED
        lo, hi = 0, usable  # the most whole blocks a sequence may span: blocks_needed_alone grows with it
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.blocks_needed_alone(mid * bs, chunk) <= usable else (lo, mid - 1)
        return lo * bs

    def _window_start(self, window: int | None, position: int) -> int:
        """The first block a token at `position` (and every later one) reads in a group with `window`."""
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def get_computed_blocks(self, seq: Sequence) -> CachedPrefix:
        """Longest cached prefix of a sequence that holds no blocks, without taking it: whole cached blocks,
        then the longest tail that goes on from them.

        A prefix of P tokens needs a full-attention group's blocks [0, P) and a sliding group's blocks that the
        window of position P reaches, all cached; the longest P every group serves wins. Stops before the last
        token: that token must be computed for its logits (and a full cached block is never written again, so
        the block holding it is never shared whole).
        """
        cached = CachedPrefix([[] for _ in self.windows], block_size=self.block_size)
        if not self.enable_prefix_caching:
            return cached
        bs = self.block_size
        parent = _root(seq)
        # [groups][blocks]: the cached block, -1 - the second tier's slot that holds it, or None
        found: list[list[int | None]] = [[] for _ in self.windows]
        full = [g for g, w in enumerate(self.windows) if w is None]
        staged: PrefixImport | None = seq.request.kv_import if self.num_groups == 1 else None
        pages: dict[int, int] = {}  # block index -> staged page, where the lookup found one
        for i in range((seq.num_tokens - 1) // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = hash_block(parent, tokens)
            hits = [self._lookup(h, parent, tokens, g) for g in range(self.num_groups)]
            if staged is not None and hits[0] is None and (page := staged.page(i, h)) is not None:
                hits, pages[i] = [_IMPORTED], page
            if any(hits[g] is None for g in full):
                break  # a sliding group's miss may lie before a later prefix's window: go on
            for g, hit in enumerate(hits):
                found[g].append(hit)
            cached.hashes.append(h)
            parent = h
        runs = [list(itertools.accumulate(found[g], lambda n, hit: 0 if hit is None else n + 1, initial=0))
                for g in range(self.num_groups)]  # [groups][k]: cached blocks in a row just before block k
        while cached.hashes and not self._serves(runs, len(cached.hashes)):
            cached.hashes.pop()
        num_blocks = len(cached.hashes)
        start = num_blocks * bs
        parent = cached.hashes[-1] if cached.hashes else _root(seq)
        cached.tail = self._lookup_tail(parent, seq.token_ids[start:min(start + bs - 1, seq.num_tokens - 1)])
        first_new = cached.num_tokens
        for g, w in enumerate(self.windows):
            lo = min(self._window_start(w, first_new), num_blocks)
            cached.blocks[g] = [NULL_BLOCK] * lo + found[g][lo:num_blocks]
            for k in range(lo, num_blocks):
                if cached.blocks[g][k] == _IMPORTED:
                    cached.imports[k] = pages[k]
                    cached.import_id = staged.import_id
                    cached.blocks[g][k] = TO_RESTORE
                elif cached.blocks[g][k] < 0:
                    cached.restores[g][k] = -1 - cached.blocks[g][k]
                    cached.blocks[g][k] = TO_RESTORE
        return cached

    def _lookup(self, block_hash: int, parent: int | None, tokens: Seq[int], group: int) -> int | None:
        """The pool's block that holds these tokens after `parent` in `group`, else -1 - the second tier's slot
        that does, else None."""
        block = self.pool.lookup(block_hash, parent, tokens, group)
        if block is not None or self.tier is None:
            return block
        slot = self.tier.lookup(block_hash, parent, tokens, group)
        return None if slot is None else -1 - slot

    def _serves(self, runs: list[list[int]], num_blocks: int) -> bool:
        """Whether every group holds what a prefix of `num_blocks` whole blocks needs cached: the blocks from the
        window's first on (`runs[g][k]`: how many blocks before block k are cached in a row in group g)."""
        return all(runs[g][num_blocks] >= num_blocks - self._window_start(w, num_blocks * self.block_size)
                   for g, w in enumerate(self.windows))

    def _lookup_tail(self, parent: int | None, tokens: Seq[int]) -> tuple[list[int], int] | None:
        """The longest tail after `parent` that is a prefix of `tokens` in every group: each group's block."""
        n = len(tokens)
        while n > 0:
            hits = [self.pool.lookup_tail(parent, tokens[:n], g) for g in range(self.num_groups)]
            if None in hits:
                return None
            shortest = min(taken for _, taken in hits)
            if shortest == n:
                return [block for block, _ in hits], n
            n = shortest
        return None

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       cached: CachedPrefix | None = None) -> list[tuple[int, int]] | None:
        """Make the block tables cover `num_new_tokens` more tokens.

        A sliding group first lets go of the blocks its window has left. The `cached` prefix (from
        `get_computed_blocks`) is attached next: its whole blocks shared, its tail copied into a block of the
        sequence's own. Returns the (src, dst) block copies the worker must do before writing (one id space: a copy
        moves a block's pages in every layer), or None when the pool is short for all groups together, in which
        case nothing else changed.
        """
        if len(seq.block_tables) != self.num_groups:
            seq.block_tables = [[] for _ in self.windows]
            seq.num_sent_blocks = [0] * self.num_groups
        num_computed = seq.num_computed_tokens + (cached.num_tokens if cached else 0)
        if cached is None and num_new_tokens > 0 and self._steady(seq, num_computed, num_new_tokens):
            return []  # most decode steps
        for g in range(self.num_groups):
            self._release_out_of_window(seq, g, num_computed)
        plans = [self._plan(seq, g, num_computed, num_new_tokens, cached) for g in range(self.num_groups)]
        # Every group takes from the one free queue: the step fits only if all groups' needs fit together.
        if sum(cost for _, _, cost in plans) > self.pool.num_free_blocks:
            return None
        if cached is None and not any(needed > 0 or cow for needed, cow, _ in plans):
            return []  # most decode steps: the tokens fit the last block, the sequence's own

        if not any(seq.block_tables) and seq.num_computed_tokens == 0 and self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += cached.num_tokens if cached else 0
            self.offload_hits += cached.num_restored_tokens if cached else 0
            self.transfer_hits += cached.num_imported_tokens if cached else 0
        if cached is not None:
            seq.block_hashes.extend(cached.hashes)
            # Every group's hits are held before any group allocates, so that no group's allocation takes a free
            # block another group is about to share (or copy, for a tail), nor the tier a slot it restores.
            for g in range(self.num_groups):
                self.pool.touch(b for b in cached.blocks[g] if _held(self.pool, b))
                seq.block_tables[g].extend(cached.blocks[g])
                if cached.restores[g]:
                    self.tier.hold(cached.restores[g].values())
            if cached.tail is not None:
                self.pool.touch(cached.tail[0])
        seq.num_computed_tokens = num_computed
        copies = [copy for g, (needed, cow, _) in enumerate(plans) for copy in self._apply(seq, g, cached, needed, cow)]
        if cached is not None and cached.tail is not None:
            self.pool.free(cached.tail[0])  # copied by this step, before any later step reuses the block
        return copies

    def _steady(self, seq: Sequence, num_computed: int, num_new_tokens: int) -> bool:
        """Whether a step of `num_new_tokens` changes nothing in any group: its tokens fit the blocks held, the
        first of which is the sequence's own, and no block is leaving a window. The common decode step, checked
        without the plan each group would make."""
        bs, pool = self.block_size, self.pool
        last, write = (num_computed + num_new_tokens - 1) // bs, num_computed // bs
        for table, window in zip(seq.block_tables, self.windows, strict=False):
            if last >= len(table) or pool.blocks[table[write]].ref_count != 1:
                return False
            if window is not None:
                start = max(0, num_computed - window + 1) // bs
                if start and _held(pool, table[start - 1]):
                    return False
        return len(seq.block_tables) == self.num_groups

    def _release_out_of_window(self, seq: Sequence, g: int, num_computed: int) -> None:
        """Free group g's blocks that lie wholly before the window of the token at `num_computed` (the next to
        compute): their entries become `NULL_BLOCK`. Released entries are a prefix of the table, so the walk
        back stops at the first one already released."""
        table = seq.block_tables[g]
        for j in range(min(self._window_start(self.windows[g], num_computed), len(table)) - 1, -1, -1):
            if not _held(self.pool, table[j]):
                break
            self.pool.free([table[j]])
            table[j] = NULL_BLOCK

    def _plan(self, seq: Sequence, g: int, num_computed: int, num_new_tokens: int,
              cached: CachedPrefix | None) -> tuple[int, bool, int]:
        """Group g's new blocks (the tail's copy among them), whether the block written first must be copied (it
        is shared after a fork), and how many free blocks that takes: those allocated, the free cached blocks it
        revives, and a free tail block, held while its copy is allocated (so that the copy is not the block
        itself)."""
        pool, table = self.pool, seq.block_tables[g]
        computed_blocks = cached.blocks[g] if cached else []
        tail = cached.tail[0][g] if cached and cached.tail else None
        needed = self.blocks_for(num_computed + num_new_tokens) - len(table) - len(computed_blocks)
        write_idx = num_computed // self.block_size
        cow = write_idx < len(table) and _held(pool, table[write_idx]) and pool.ref_count(table[write_idx]) > 1
        revived = sum(1 for b in computed_blocks if _held(pool, b) and pool.ref_count(b) == 0)
        held = tail is not None and tail not in computed_blocks and pool.ref_count(tail) == 0
        restored = len(cached.restores[g]) + len(cached.imports) if cached else 0
        return needed, cow, max(needed, 0) + cow + revived + held + restored

    def _apply(self, seq: Sequence, g: int, cached: CachedPrefix | None, needed: int,
               cow: bool) -> list[tuple[int, int]]:
        """Group g's new blocks and copies; the cached blocks are already in its table, the tail's source held."""
        pool, table = self.pool, seq.block_tables[g]
        copies = []
        if cached is not None:
            start = len(table) - len(cached.blocks[g])
            for k, slot in cached.restores[g].items():
                block = pool.allocate().block_id
                entry = self.tier.restore(slot, block)  # copied back before the step's forward
                pool.cache(block, entry.block_hash, entry.parent_hash, entry.token_ids, g)
                table[start + k] = block
            bs = self.block_size
            for k, page in cached.imports.items():  # one group: this is it
                block = pool.allocate().block_id
                parent = cached.hashes[k - 1] if k else _root(seq)
                pool.cache(block, cached.hashes[k], parent, seq.token_ids[k * bs:(k + 1) * bs], g)
                table[start + k] = block
                self._imports.append((cached.import_id, page, block))  # copied in before the step's forward
        if cached is not None and cached.tail is not None:
            dst = pool.allocate().block_id
            table.append(dst)
            copies.append((cached.tail[0][g], dst))
            needed -= 1
        if cow:
            write_idx = seq.num_computed_tokens // self.block_size
            src = table[write_idx]
            dst = pool.allocate().block_id
            pool.free([src])
            table[write_idx] = dst
            seq.num_sent_blocks[g] = min(seq.num_sent_blocks[g], write_idx)
            copies.append((src, dst))
        for _ in range(needed):
            table.append(pool.allocate().block_id)
        return copies

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register blocks that became full and computed, each group's under (group, hash). A block whose last
        token is still pending (a step scheduled ahead computes it) waits: its hash needs that token. A block a
        window let go before it was registered stays out of that group's cache."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), min(seq.num_computed_tokens, seq.num_tokens) // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else _root(seq)
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = hash_block(parent, tokens)
            if self.enable_prefix_caching:
                for g, table in enumerate(seq.block_tables):
                    if _held(self.pool, table[i]):
                        self.pool.cache(table[i], h, parent, tokens, g)
            seq.block_hashes.append(h)

    def rollback(self, seq: Sequence, num_computed: int) -> None:
        """Forget what a step computed past `num_computed` tokens (proposals it rejected): the sequence is computed
        up to there, and each group's blocks past the one that holds that position (where its next token goes) are
        freed. Those blocks were allocated by the step and never registered (`cache_full_blocks` registers only
        blocks of known tokens), so no cached prefix names their K/V."""
        if num_computed > seq.num_computed_tokens:
            raise ValueError(f"rollback to {num_computed} tokens, past the {seq.num_computed_tokens} computed")
        seq.num_computed_tokens = num_computed
        keep = num_computed // self.block_size + 1
        for g, table in enumerate(seq.block_tables):
            rejected = table[keep:]
            if rejected:
                del table[keep:]
                self.pool.free(b for b in reversed(rejected) if _held(self.pool, b))
                seq.num_sent_blocks[g] = min(seq.num_sent_blocks[g], keep)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; writes copy on demand."""
        for table in parent.block_tables:
            self.pool.touch(b for b in table if _held(self.pool, b))
        child.block_tables = [list(table) for table in parent.block_tables]
        child.num_sent_blocks = [0] * self.num_groups
        child.block_hashes = list(parent.block_hashes)
        child.rope_long = parent.rope_long
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence, tail_written: bool = True) -> None:
        """Release a sequence's blocks; tail blocks first so they are evicted first. A partial last block's
        computed tokens stay findable (`BlockPool.cache_tail`) until the block is allocated again: a
        sequence that goes on from them (a beam search's next step, a preempted sequence readmitted, the
        next turn of a chat) copies the block instead of computing them. `tail_written=False`: that block's
        copy-on-write copy was never sent (a sequence preempted in the step that allocated it): it holds
        nothing, and is not offered."""
        computed = min(seq.num_computed_tokens, seq.num_tokens)  # a pending token's K/V is not written yet
        full, partial = divmod(computed, self.block_size)
        pool = self.pool
        for g, table in enumerate(seq.block_tables):
            if (self.enable_prefix_caching and tail_written and partial and full < len(table)
                    and _held(pool, table[full])
                    and len(seq.block_hashes) >= full):
                parent = seq.block_hashes[full - 1] if full else _root(seq)
                start = full * self.block_size
                pool.cache_tail(table[full], parent, seq.token_ids[start:start + partial], g)
        tables = seq.block_tables
        if len(tables) == 1:
            pool.free(b for b in reversed(tables[0]) if _held(pool, b))
        else:  # the shared queue gets every group's last blocks before any group's earlier ones
            for k in range(max(map(len, tables)) - 1, -1, -1):
                pool.free(t[k] for t in tables if k < len(t) and _held(pool, t[k]))
        seq.block_tables = [[] for _ in self.windows]
        seq.num_sent_blocks = [0] * self.num_groups
        seq.block_hashes = []
        seq.num_computed_tokens = 0


def _held(pool: BlockPool, block_id: int) -> bool:
    """Whether a table entry is a block the sequence holds, not a window's placeholder (`NULL_BLOCK`)."""
    return block_id >= pool.reserved
