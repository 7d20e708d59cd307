"""Block pool and block manager: ref counts, prefix caching, LRU reuse, copy-on-write, invariants."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import block_manager as bm_mod
from pagedserve.scheduler.block_manager import BlockManager, hash_block, prefix_hashes
from pagedserve.scheduler.block_pool import BlockPool
from pagedserve.scheduler.prefix_transfer import PrefixImport
from pagedserve.scheduler.request import Request, Sequence

BS = 4


def make_seq(tokens: list[int], seq_id: int = 0, cache_salt: str | None = None) -> Sequence:
    request = Request(f"r{seq_id}", list(tokens), SamplingParams(max_tokens=1, cache_salt=cache_salt))
    return Sequence(seq_id, request, list(tokens), sample_index=0)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """Pretend a step computed `num_tokens` more tokens of `seq`."""
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)


def admit(bm: BlockManager, seq: Sequence) -> list[list[tuple[int, int]]] | None:
    cached = bm.get_computed_blocks(seq)
    return bm.allocate_slots(seq, seq.num_tokens - cached.num_tokens, cached)


def test_pool_errors_name_the_problem():
    pool = BlockPool(4)
    block = pool.allocate()
    pool.free([block.block_id])
    with pytest.raises(ValueError, match="double free"):
        pool.free([block.block_id])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([4])
    with pytest.raises(ValueError, match="out of range"):
        pool.touch([-1])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    for _ in range(4):
        pool.allocate()
    with pytest.raises(RuntimeError, match="no free"):
        pool.allocate()


def test_prefix_hit_shares_blocks_and_counts_tokens():
    bm = BlockManager(16, BS)
    a = make_seq(list(range(10)), 0)
    assert admit(bm, a) == []
    compute(bm, a, 10)
    assert len(a.block_hashes) == 2  # two full blocks cached, the partial third is not
    b = make_seq(list(range(8)) + [99, 98, 97], 1)
    admit(bm, b)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.pool.ref_count(a.block_table[0]) == 2
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 10 + 11


def test_a_salted_prefix_is_found_only_under_the_same_salt():
    bm = BlockManager(32, BS)
    prompt = list(range(10))
    first = make_seq(prompt, 0, cache_salt="tenant-a")
    admit(bm, first)
    compute(bm, first, 10)
    hits = []
    for seq_id, salt in enumerate([None, "tenant-b", "tenant-a", "tenant-a2"], start=1):
        seq = make_seq(prompt, seq_id, cache_salt=salt)
        admit(bm, seq)
        hits.append(seq.num_computed_tokens)
        compute(bm, seq, 10 - seq.num_computed_tokens)
    assert hits == [0, 0, 8, 0]
    # the unsalted copy of the prompt is cached under its own hashes, as before
    assert len(bm.get_computed_blocks(make_seq(prompt, 9)).blocks[0]) == 2
    assert bm.get_computed_blocks(make_seq(prompt, 10, "tenant-c")).num_tokens == 0


def test_reset_forgets_blocks_and_prefixes_but_keeps_counting():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(10)))
    admit(bm, a)
    compute(bm, a, 10)
    with pytest.raises(RuntimeError, match="3 KV blocks still held"):
        bm.reset()
    bm.free(a)
    assert bm.pool.num_cached_blocks == 2
    bm.reset()
    assert bm.pool.num_cached_blocks == 0 and bm.num_free_blocks == 8
    b = make_seq(list(range(10)), seq_id=1)
    assert bm.get_computed_blocks(b).num_tokens == 0  # the rebuilt KV pool holds nothing to hit
    admit(bm, b)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (20, 0)
    bm.pool.check_invariants()


def test_full_hit_still_computes_last_token():
    bm = BlockManager(16, BS)
    a = make_seq(list(range(8)), 0)
    admit(bm, a)
    compute(bm, a, 8)
    b = make_seq(list(range(8)), 1)
    admit(bm, b)
    # Both blocks are cached, but the last token's logits are needed: only the first block is reused.
    assert b.num_computed_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_freed_blocks_keep_hash_until_reused_lru_order():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(9)), 0)
    admit(bm, a)
    compute(bm, a, 9)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.pool.num_cached_blocks == 2
    # A revived hit comes back out of the free queue.
    b = make_seq(list(range(9)), 1)
    admit(bm, b)
    assert b.num_computed_tokens == 8 and bm.num_free_blocks == 1
    bm.free(b)
    # Allocating everything evicts the cached blocks only when they are reused.
    c = make_seq([50 + i for i in range(16)], 2)
    admit(bm, c)
    assert bm.pool.num_cached_blocks == 0 and bm.num_free_blocks == 0
    bm.free(c)


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(bm_mod, "hash_block", lambda parent, tokens: 1234)
    bm = BlockManager(8, BS)
    a = make_seq([1, 2, 3, 4, 5], 0)
    admit(bm, a)
    compute(bm, a, 5)
    b = make_seq([9, 9, 9, 9, 5], 1)
    admit(bm, b)
    assert b.num_computed_tokens == 0 and b.block_table[0] != a.block_table[0]


def test_hash_is_chained():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0]), [1, 2])


def test_fork_then_copy_on_write_of_shared_partial_block():
    bm = BlockManager(8, BS)
    parent = make_seq([1, 2, 3, 4, 5, 6], 0)
    admit(bm, parent)
    compute(bm, parent, 6)
    child = make_seq([1, 2, 3, 4, 5, 6], 1)
    bm.fork(parent, child)
    assert bm.pool.ref_count(parent.block_table[1]) == 2
    parent.token_ids.append(7)
    child.token_ids.append(8)
    copies = bm.allocate_slots(parent, 1)
    assert copies == [(child.block_table[1], parent.block_table[1])]
    assert bm.allocate_slots(child, 1) == []  # now the child's block is its own
    assert parent.block_table[0] == child.block_table[0]  # full block stays shared
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_a_freed_partial_block_is_copied_not_computed_again():
    """A sequence that lets its blocks go leaves its partial last block's computed tokens findable: one that
    goes on from all of them (a beam's next step, the next chat turn) copies that block and computes only
    what follows; one that shares fewer of them, or another salt, does not."""
    bm = BlockManager(16, BS)
    a = make_seq(list(range(10)), 0)
    admit(bm, a)
    compute(bm, a, 10)
    a.token_ids.append(10)  # drawn, never computed: not part of the tail
    tail_block = a.block_table[2]
    bm.free(a)
    b = make_seq(list(range(10)) + [42], 1)
    copies = admit(bm, b)
    assert b.num_computed_tokens == 10 and copies == [(tail_block, b.block_table[2])] != [(tail_block, tail_block)]
    assert bm.prefix_cache_hits == 10 and bm.pool.ref_count(tail_block) == 0
    for seq_id, tokens, salt in ((2, list(range(9)) + [7, 7], None), (3, list(range(10)) + [42], "other")):
        seq = make_seq(tokens, seq_id, salt)
        admit(bm, seq)
        assert seq.num_computed_tokens == (8 if salt is None else 0)
        bm.free(seq)
    # allocated again, the block forgets its tail
    bm.free(b)
    while bm.num_free_blocks:
        bm.pool.allocate()
    assert bm.pool.lookup_tail(None, [0]) is None and not bm.pool._tails
    bm.pool.check_invariants()


def test_allocate_slots_changes_nothing_when_short():
    bm = BlockManager(2, BS)
    a = make_seq(list(range(12)), 0)
    assert admit(bm, a) is None
    assert a.block_table == [] and bm.num_free_blocks == 2 and bm.prefix_cache_queries == 0


class OffloadWorker:
    """What a worker's second tier holds: each slot's copy of a block's page, and the hash it was saved under."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple[list, int]] = {}

    def copy(self, saves: list[tuple[int, int, int]], loads: list[tuple[int, int, int]],
             read: Callable[[int], list], write: Callable[[int, list], None]) -> None:
        """A step's saves, then its loads; `read(block)` is a block's page, `write(block, page)` replaces it."""
        for block, slot, block_hash in saves:
            self.slots[slot] = (list(read(block)), block_hash)
        for slot, block, block_hash in loads:
            assert slot in self.slots and self.slots[slot][1] == block_hash, f"slot {slot} restored as another block"
            write(block, list(self.slots[slot][0]))


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, steps, forks, writes and frees; the pool stays consistent throughout, and every
    sequence reads what was written for its tokens."""

    @initialize(num_blocks=st.integers(4, 16), caching=st.booleans(), offload=st.sampled_from([0, 0, 1, 3, 8]))
    def setup(self, num_blocks, caching, offload):
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching, offload_blocks=offload * caching)
        self.seqs: list[Sequence] = []
        self.next_id = 0
        # What each block's slots hold, as a worker would have written them: (position, token) per slot.
        self.kv: list[list[tuple[int, int] | None]] = [[None] * BS for _ in range(num_blocks)]
        self.tier = OffloadWorker()
        self.history: list[list[int]] = []  # the tokens of every sequence admitted
        self.staged: dict[int, list[list[tuple[int, int]]]] = {}  # import id -> its pages, another replica's K/V

    def run(self, seq: Sequence, copies: list[tuple[int, int]], num_tokens: int) -> None:
        """A worker's step: the second tier's copies, the block copies, then the K/V of `num_tokens` more tokens
        into their slots."""
        self.tier.copy(*self.bm.take_offload_copies(), self.kv.__getitem__, self.kv.__setitem__)
        for import_id, page, block in self.bm.take_imports():
            self.kv[block] = list(self.staged[import_id][page])
        for src, dst in copies:
            self.kv[dst] = list(self.kv[src])
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_tokens):
            self.kv[seq.block_table[pos // BS]][pos % BS] = (pos, seq.token_ids[pos])
        compute(self.bm, seq, num_tokens)

    # A tiny alphabet makes shared prefixes (and so cache hits) common.
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def admit(self, tokens):
        seq = make_seq(tokens, self.next_id)
        self.next_id += 1
        copies = admit(self.bm, seq)
        if copies is not None:
            self.run(seq, copies, seq.num_tokens - seq.num_computed_tokens)
            self.seqs.append(seq)
            self.history.append(list(tokens))

    @precondition(lambda self: self.history)
    @rule(i=st.integers(0, 100), extra=st.lists(st.integers(0, 2), max_size=3))
    def admit_again(self, i, extra):
        """A prompt seen before, perhaps going on: its blocks are in the pool, the second tier, or gone."""
        self.admit(self.history[i % len(self.history)] + extra)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20), first=st.integers(0, 2),
          count=st.integers(0, 5), other=st.sampled_from([False, False, True]))
    def admit_fetched(self, tokens, first, count, other):
        """A prompt with its blocks [first, first + count) fetched from another replica that computed it (or, `other`,
        that computed another prompt: no page may be taken for this one's): found where the pool and the second tier
        lack them."""
        source = [(t + 1) % 3 for t in tokens] if other else tokens
        hashes = prefix_hashes(source, BS)[first:first + count]
        import_id = len(self.staged)
        self.staged[import_id] = [[(pos, source[pos]) for pos in range(k * BS, (k + 1) * BS)]
                                  for k in range(first, first + len(hashes))]
        seq = make_seq(tokens, self.next_id)
        self.next_id += 1
        seq.request.kv_import = PrefixImport(import_id, first, tuple(hashes))
        hits = self.bm.transfer_hits
        copies = admit(self.bm, seq)
        seq.request.kv_import = None  # released, as the scheduler does on admission
        assert not (other and self.bm.transfer_hits > hits)
        if copies is not None:
            self.run(seq, copies, seq.num_tokens - seq.num_computed_tokens)
            self.seqs.append(seq)
            self.history.append(list(tokens))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), token=st.integers(0, 2))
    def decode(self, i, token):
        seq = self.seqs[i % len(self.seqs)]
        seq.token_ids.append(token)
        copies = self.bm.allocate_slots(seq, 1)
        if copies is not None:
            self.run(seq, copies, 1)
        else:
            seq.token_ids.pop()

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        parent = self.seqs[i % len(self.seqs)]
        child = make_seq(list(parent.token_ids), self.next_id)
        self.next_id += 1
        self.bm.fork(parent, child)
        self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.bm.free(self.seqs.pop(i % len(self.seqs)))

    @invariant()
    def pool_consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.pool.check_invariants()
        if self.bm.tier is not None:
            self.bm.tier.check_invariants()
        # Every reference is held by some live sequence's block table.
        held: dict[int, int] = {}
        for seq in self.seqs:
            assert len(seq.block_table) == self.bm.blocks_for(seq.num_computed_tokens)
            for b in seq.block_table:
                held[b] = held.get(b, 0) + 1
        for block in self.bm.pool.blocks:
            assert block.ref_count == held.get(block.block_id, 0)
        # Every sequence reads its own tokens' K/V through its table, however its blocks came (computed, a
        # cached prefix, a copied tail, a fork, a copy on write).
        for seq in self.seqs:
            for pos in range(seq.num_computed_tokens):
                assert self.kv[seq.block_table[pos // BS]][pos % BS] == (pos, seq.token_ids[pos]), (seq.seq_id, pos)

    def teardown(self):
        if hasattr(self, "bm"):
            for seq in self.seqs:
                self.bm.free(seq)
            assert self.bm.num_free_blocks == self.bm.num_total_blocks
            self.bm.pool.check_invariants()


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
