"""KV memory bounded by the sliding window: a KV-cache group per attention type, all groups sharing one pool.

The block manager lets a sliding group's blocks go once they lie wholly before the window of the next token to
compute, and any group may take them next. A model-free worker (as tests/test_scheduler.py's) writes each token
into one shared store of pages, tagged with the group that wrote it, and reads back, per group, exactly what a
layer of that group attends to, so a block let go too early, a block two groups hold at once, a wrong placeholder
or a bad prefix hit shows in the tokens it derives. Then the kernels over tables the block manager made, and the
engine against transformers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.batch import SampledTokens, StepBatch, StepOutput
from pagedserve.scheduler.block_manager import NULL_BLOCK, BlockManager
from pagedserve.scheduler.kv_groups import blocks_held_at_most, kv_groups, layer_group_slots, layers_per_group
from pagedserve.scheduler.request import Request, Sequence
from pagedserve.scheduler.scheduler import Scheduler
from tests.test_block_manager import OffloadWorker
from tests.test_scheduler import add, next_token, outputs, run

BS = 4


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    request = Request(f"r{seq_id}", list(tokens), SamplingParams(max_tokens=1))
    return Sequence(seq_id, request, list(tokens), sample_index=0)


def held(bm: BlockManager, seq: Sequence, group: int) -> int:
    """Blocks the sequence holds in a group (placeholders not counted)."""
    return sum(1 for b in seq.block_tables[group] if b >= bm.pool.reserved)


def held_all(bm: BlockManager, seq: Sequence) -> int:
    return sum(held(bm, seq, g) for g in range(bm.num_groups))


def step(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    assert bm.allocate_slots(seq, num_tokens) is not None
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)


# --- groups and the block manager ------------------------------------------------------------------------------


def test_layers_group_by_attention_type_in_groups_of_equal_size():
    assert [(g.window, g.layers) for g in kv_groups([None, None])] == [(None, (0, 1))]
    assert [(g.window, g.layers) for g in kv_groups([16] * 3)] == [(16, (0, 1, 2))]
    # Gemma 3's shape: five sliding layers to one full; 8 full layers make 1 full group and 5 sliding groups of 8
    gemma3 = [None if i % 6 == 5 else 1024 for i in range(48)]
    groups = kv_groups(gemma3)
    assert [(g.window, len(g.layers)) for g in groups] == [(None, 8)] + [(1024, 8)] * 5
    assert sorted(i for g in groups for i in g.layers) == list(range(48)) and layers_per_group(groups) == 8
    # counts the smallest does not divide: the last group of a type is short (its missing layers are padding)
    groups = kv_groups([8, None, 8, 8, None, 8, 8])
    assert [(g.window, g.layers) for g in groups] == [(None, (1, 4)), (8, (0, 2)), (8, (3, 5)), (8, (6,))]
    # counts close to each other: one group each, the smaller padded, rather than many small groups
    alternating = [None if i % 2 else 8 for i in range(11)]  # 5 full, 6 sliding
    assert [(g.window, g.layers) for g in kv_groups(alternating)] == [(None, (1, 3, 5, 7, 9)),
                                                                        (8, (0, 2, 4, 6, 8, 10))]
    # Qwen2's first full layer beside two sliding ones: groups of one layer, no padding
    assert [(g.window, g.layers) for g in kv_groups([None, 40, 40])] == [(None, (0,)), (40, (1,)), (40, (2,))]
    # each layer of a group has a tensor of the shared pool of its own; layer j of every group shares tensor j
    slots = layer_group_slots(kv_groups([8, None, 8, 8, None, 8, 8]))
    assert slots == {1: (0, 0), 4: (0, 1), 0: (1, 0), 2: (1, 1), 3: (2, 0), 5: (2, 1), 6: (3, 0)}


def test_the_pool_tensor_holds_layer_j_of_every_group_in_tensor_j():
    from types import SimpleNamespace

    from pagedserve.workers.kv_pool import layer_caches

    config = SimpleNamespace(num_layers=5, layer_windows=(None, 4, 4, None, 4))  # what layer_caches reads
    pool = torch.zeros(2, 2, 3, BS, 1, 8)  # [layers_per_group, 2, N, B, Hkv, D]
    caches = layer_caches(config, pool)
    assert [c.data_ptr() for c in caches] == [pool[j].data_ptr() for j in (0, 0, 1, 1, 0)]


@pytest.mark.parametrize("windows", [(None, 8), (8,)], ids=["hybrid", "all-sliding"])
def test_sliding_blocks_are_released_as_a_long_sequence_advances(windows):
    """A 400-token sequence decoded a token a step holds at most a window's span in its sliding group (8
    positions: 3 blocks of 4), and its full group every block; the sliding group's freed entries are the
    placeholder, what it let go is free for any group, and every block is back at the end."""
    bm = BlockManager(120 * len(windows), BS, windows=windows)
    slide = len(windows) - 1
    seq = make_seq(list(range(5)))
    step(bm, seq, 5)
    most = 0
    while seq.num_tokens < 400:
        seq.token_ids.append(seq.num_tokens % 7)
        step(bm, seq, 1)
        most = max(most, held(bm, seq, slide))
        start = max(0, seq.num_computed_tokens - 8) // BS  # the window of the token just computed
        assert seq.block_tables[slide][:start] == [NULL_BLOCK] * start
        assert NULL_BLOCK not in seq.block_tables[slide][start:]
        if windows[0] is None:
            assert held(bm, seq, 0) == -(-seq.num_computed_tokens // BS)
        assert bm.num_free_blocks == bm.num_total_blocks - held_all(bm, seq)
    assert most == 3 == blocks_held_at_most(8, BS, 400, 1)
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_total_blocks
    bm.pool.check_invariants()


def test_blocks_a_sliding_group_lets_go_serve_the_full_group():
    """A pool of 30 blocks holds a 100-token sequence's 25 full-attention blocks only because its sliding group
    gives its blocks back as the window moves: separate pools of 15 each would hold 60 tokens."""
    bm = BlockManager(31, BS, windows=(None, 6))
    seq = make_seq(list(range(100)))
    for _ in range(100 // 4):
        step(bm, seq, 4)
    assert held(bm, seq, 0) == 25 and held(bm, seq, 1) == 3
    assert bm.num_free_blocks == 30 - 28
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_total_blocks == 30
    bm.pool.check_invariants()


def test_a_prefill_chunk_holds_its_span_then_lets_it_go():
    """A chunk of 40 tokens needs all its blocks while it is computed; the next step keeps only the window."""
    bm = BlockManager(80, BS, windows=(None, 6))
    seq = make_seq(list(range(100)))
    step(bm, seq, 40)
    assert held(bm, seq, 1) == 10 and held(bm, seq, 0) == 10
    step(bm, seq, 40)  # reads keys from 40 - 6 + 1 = 35 on: blocks 8 .. 19
    assert held(bm, seq, 1) == 12 and held(bm, seq, 0) == 20
    step(bm, seq, 1)  # position 80 reads from 75: blocks 18, 19, 20
    assert held(bm, seq, 1) == 3
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_total_blocks == 79


def test_a_step_is_refused_unless_every_group_fits_together():
    """Each group alone would fit the free blocks; together they do not: nothing changes."""
    bm = BlockManager(13, BS, windows=(None, 100))
    seq = make_seq(list(range(28)))
    assert bm.allocate_slots(seq, 28) is None  # 7 + 7 blocks, 12 free
    assert bm.num_free_blocks == 12 and seq.num_computed_tokens == 0 and not any(seq.block_tables)
    assert bm.allocate_slots(seq, 24) is not None


def test_fork_shares_every_group_and_copies_on_write_per_group():
    bm = BlockManager(60, BS, windows=(None, 5))
    parent = make_seq(list(range(18)))
    step(bm, parent, 18)
    child = make_seq(list(parent.token_ids), 1)
    bm.fork(parent, child)
    parent.token_ids.append(1)
    child.token_ids.append(2)
    copies = bm.allocate_slots(parent, 1)
    # the shared partial block (positions 16..19) is copied in both groups, each into a block of its own
    assert len(copies) == 2 and len({dst for _, dst in copies}) == 2
    assert bm.allocate_slots(child, 1) == []  # the child's block is its own now
    for seq in (parent, child):
        seq.num_computed_tokens += 1
    for _ in range(20):  # both advance: the sliding group lets go of shared blocks one reference at a time
        for seq in (parent, child):
            seq.token_ids.append(3)
            step(bm, seq, 1)
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == bm.num_total_blocks
    bm.pool.check_invariants()


def test_prefix_hit_on_a_hybrid_model_reuses_both_groups():
    """A hit of P tokens takes the full group's blocks [0, P) and, in the sliding group, only those its window
    at P reaches: the rest of the sliding table is the placeholder. Each group's blocks are its own cache entries
    (the same tokens' K/V differ between groups)."""
    bm = BlockManager(80, BS, windows=(None, 6))
    prompt = list(range(40))
    a = make_seq(prompt)
    step(bm, a, 40)
    a.token_ids.append(99)
    step(bm, a, 1)  # blocks 0 .. 7 of the sliding group are let go, still cached
    full_blocks, sliding_blocks = list(a.block_tables[0][:10]), list(a.block_tables[1][8:10])
    bm.free(a)
    b = make_seq(prompt + [50, 51, 52])
    cached = bm.get_computed_blocks(b)
    assert cached.num_tokens == 40
    assert cached.blocks[0] == full_blocks and cached.blocks[1][8:] == sliding_blocks
    assert cached.blocks[1][:8] == [NULL_BLOCK] * 8  # position 40 sees keys from 35 on: blocks 8 and 9
    assert not set(full_blocks) & set(sliding_blocks)
    assert bm.allocate_slots(b, 3, cached) == []
    assert b.num_computed_tokens == 40 and bm.prefix_cache_hits == 40
    assert held(bm, b, 1) == 3 and held(bm, b, 0) == 11
    bm.free(b)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_prefix_hit_is_cut_short_where_the_sliding_group_evicted_its_blocks():
    """The full group still holds all 10 blocks of the prompt, but the sliding group's blocks before the end were
    reused by another sequence: the hit is the longest prefix whose window's blocks are all still cached."""
    bm = BlockManager(33, BS, windows=(None, 6))
    prompt = list(range(40))
    a = make_seq(prompt)
    for _ in range(10):  # prefill in chunks of 4: the sliding group lets go of blocks 0 .. 6 as it goes
        step(bm, a, 4)
    hashes, full_blocks = list(a.block_hashes), list(a.block_tables[0])
    bm.free(a)  # 20 blocks of a's in the queue behind 12 never used
    bm.pool.touch(full_blocks)  # the full group's blocks were read again since: to the queue's tail
    bm.pool.free(full_blocks)
    other = make_seq([7] * 40, 1)
    step(bm, other, 40)  # takes 20 blocks, least recently freed first: 12 unused, then a's sliding ones
    bm.free(other)
    sliding = set(bm.pool.cached_hashes(1))
    assert set(hashes) <= set(bm.pool.cached_hashes(0)) and not set(hashes) <= sliding
    b = make_seq(prompt + [50])
    cached = bm.get_computed_blocks(b)
    # the longest P (whole blocks) whose window's blocks [(P - 6 + 1) // 4, P // 4) the sliding group still holds
    expected = max(k for k in range(11) if all(h in sliding for h in hashes[max(0, k * 4 - 5) // 4:k]))
    assert cached.num_tokens == expected * BS and 0 < expected < 10
    assert bm.allocate_slots(b, 41 - cached.num_tokens, cached) is not None
    bm.free(b)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_a_tail_is_taken_only_when_every_group_has_it():
    bm = BlockManager(40, BS, windows=(None, 6))
    a = make_seq(list(range(10)))
    step(bm, a, 10)
    bm.free(a)  # tokens 8, 9 stay findable as a tail in both groups
    b = make_seq(list(range(12)))
    cached = bm.get_computed_blocks(b)
    assert cached.num_tokens == 10 and cached.tail is not None and len(set(cached.tail[0])) == 2
    copies = bm.allocate_slots(b, 2, cached)
    assert sorted(src for src, _ in copies) == sorted(cached.tail[0])
    bm.free(b)
    assert bm.num_free_blocks == bm.num_total_blocks


class WindowedBlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, steps, forks and frees on a hybrid manager whose groups share one pool: the pool stays
    consistent (ref counts are the tables' references over all groups), every sliding table holds blocks only
    where the window of its next token reaches, and every sequence reads, through each group's table, what that
    group wrote for the positions its layers attend to. The worker's store is one page per block, tagged with
    the group that wrote it: two groups holding one block at once would overwrite each other's tokens."""

    @initialize(num_blocks=st.integers(8, 40), window=st.integers(1, 10), more=st.sampled_from([(), (None,), (3,)]),
                caching=st.booleans(), offload=st.sampled_from([0, 0, 2, 12]))
    def setup(self, num_blocks, window, more, caching, offload):
        self.windows = (None, window, *more)
        self.bm = BlockManager(num_blocks, BS, caching, windows=self.windows, offload_blocks=offload * caching)
        self.seqs: list[Sequence] = []
        self.next_id = 0
        self.kv = [[None] * BS for _ in range(num_blocks)]  # [block][offset]: (group, position, token)
        self.tier = OffloadWorker()

    def run(self, seq: Sequence, copies: list[tuple[int, int]], num_tokens: int) -> None:
        self.tier.copy(*self.bm.take_offload_copies(), self.kv.__getitem__, self.kv.__setitem__)
        pages = {src: list(self.kv[src]) for src, _ in copies}  # every source read before any is written
        for src, dst in copies:
            self.kv[dst] = list(pages[src])
        for g, window in enumerate(self.windows):
            # a sliding table holds blocks from the window of the first token to compute on, placeholders before
            start = 0 if window is None else max(0, seq.num_computed_tokens - window + 1) // BS
            assert all(b == NULL_BLOCK for b in seq.block_tables[g][:start])
            assert NULL_BLOCK not in seq.block_tables[g][start:]
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_tokens):
            for g in range(len(self.windows)):
                block = seq.block_tables[g][pos // BS]
                assert block >= self.bm.pool.reserved, "a token written into the placeholder"
                self.kv[block][pos % BS] = (g, pos, seq.token_ids[pos])
        seq.num_computed_tokens += num_tokens
        self.bm.cache_full_blocks(seq)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=30), chunk=st.integers(1, 30))
    def admit(self, tokens, chunk):
        seq = make_seq(tokens, self.next_id)
        self.next_id += 1
        cached = self.bm.get_computed_blocks(seq)
        num_new = min(seq.num_tokens - cached.num_tokens, chunk)
        copies = self.bm.allocate_slots(seq, num_new, cached)
        if copies is not None:
            self.run(seq, copies, num_new)
            self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), token=st.integers(0, 2))
    def decode(self, i, token):
        seq = self.seqs[i % len(self.seqs)]
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(token)
        copies = self.bm.allocate_slots(seq, 1)
        if copies is not None:
            self.run(seq, copies, 1)

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
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        pool = self.bm.pool
        pool.check_invariants()
        refs: dict[int, int] = {}
        owner: dict[int, int] = {}  # block -> the one group whose tables hold it
        for seq in self.seqs:
            for g, table in enumerate(seq.block_tables):
                for b in table:
                    if b >= pool.reserved:
                        refs[b] = refs.get(b, 0) + 1
                        assert owner.setdefault(b, g) == g, f"block {b} in groups {owner[b]} and {g}"
        for block in pool.blocks:
            assert block.ref_count == refs.get(block.block_id, 0)
        for seq in self.seqs:
            computed = seq.num_computed_tokens
            assert {len(t) for t in seq.block_tables} == {-(-computed // BS)}
            # the next query, at position `computed`, attends to computed - window + 1 on in a sliding group
            for g, window in enumerate(self.windows):
                lo = 0 if window is None else max(0, computed - window + 1)
                for pos in range(lo, computed):
                    block = seq.block_tables[g][pos // BS]
                    assert self.kv[block][pos % BS] == (g, pos, seq.token_ids[pos]), (g, seq.seq_id, pos)

    def teardown(self):
        if hasattr(self, "bm"):
            for seq in self.seqs:
                self.bm.free(seq)
            assert self.bm.num_free_blocks == self.bm.num_total_blocks
            self.bm.pool.check_invariants()


TestWindowedBlockManagerMachine = WindowedBlockManagerMachine.TestCase
TestWindowedBlockManagerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


# --- the scheduler, against a model-free worker ------------------------------------------------------------------


class GroupSlotWorker:
    """tests/test_scheduler.py's SlotWorker for a model with KV-cache groups sharing one pool: each new token goes
    into its slot of every group's table, tagged with the group (one store: a block two groups hold at once shows);
    each row reads back, per group, the positions that group's layers attend to (a sliding group: from the window
    of the row's first new token on) and checks them; the next token is derived from the full group's whole
    context, or, where every layer slides, from the last `window` tokens."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        bm = sched.block_manager
        self.bs = bm.block_size
        self.windows = bm.windows
        self.slots = [None] * (bm.pool.num_blocks * self.bs)  # [slot]: (group, position, token)
        self.tables: list[dict[int, list[int]]] = [{} for _ in bm.windows]
        self.batches: list[StepBatch] = []
        self.last_draws: list[int] = []
        self.most_held = 0  # the most blocks a sequence held in a sliding group
        self.offloaded = OffloadWorker()  # the second tier

    def execute(self, batch: StepBatch) -> StepOutput:
        self.batches.append(batch)
        self.check_held()
        bs = self.bs
        input_ids = list(batch.input_ids)
        for index, sample in batch.deferred_inputs:
            input_ids[index] = self.last_draws[sample]
        self.offloaded.copy(batch.kv_saves, batch.kv_loads, lambda b: self.slots[b * bs:(b + 1) * bs],
                            lambda b, page: self.slots.__setitem__(slice(b * bs, (b + 1) * bs), page))
        pages = {src: self.slots[src * bs:(src + 1) * bs] for src, _ in batch.block_copies}
        for src, dst in batch.block_copies:
            self.slots[dst * bs:(dst + 1) * bs] = pages[src]
        for g in range(len(self.windows)):
            for slot, start, ids in batch.table_updates[g]:
                table = self.tables[g].setdefault(slot, [])
                assert start <= len(table)
                table[start:] = ids
        contexts = []
        for r in range(batch.num_rows):
            q = input_ids[batch.cu_seqlens_q[r]:batch.cu_seqlens_q[r + 1]]
            length = batch.context_lens[r]
            first = length - len(q)
            for g, window in enumerate(self.windows):
                table = self.tables[g][batch.slots[r]]
                assert len(table) == -(-length // bs)
                for i, token in enumerate(q):
                    pos = first + i
                    assert window is None or table[pos // bs] != NULL_BLOCK, "a write into the placeholder"
                    self.slots[table[pos // bs] * bs + pos % bs] = (g, pos, token)
            contexts.append(None)
            for g, window in enumerate(self.windows):  # read after every group wrote: a shared block shows
                table = self.tables[g][batch.slots[r]]
                lo = 0 if window is None else max(0, first - window + 1)
                seen = []
                for pos in range(lo, length):
                    entry = self.slots[table[pos // bs] * bs + pos % bs]
                    assert entry is not None and entry[:2] == (g, pos), f"group {g}: position {pos} holds {entry}"
                    seen.append(entry[2])
                if contexts[-1] is None:  # the first group: full attention where the model has any
                    contexts[-1] = seen if window is None else seen[-window:]
        samples = [SampledTokens([next_token(contexts[s.row], s.sample_index + i) for i in range(s.num_samples)])
                   for s in batch.samples]
        self.last_draws = [s.token_ids[0] for s in samples]
        return StepOutput(samples)

    def check_held(self) -> None:
        """Each running sequence holds in a sliding group at most what a step of the budget's tokens reads."""
        bm = self.sched.block_manager
        for seq in self.sched.running:
            for g, window in enumerate(self.windows):
                if window is not None and len(seq.block_tables) == len(self.windows):
                    n = held(bm, seq, g)
                    self.most_held = max(self.most_held, n)
                    assert n <= blocks_held_at_most(window, self.bs, seq.num_computed_tokens,
                                                    self.sched.max_num_batched_tokens)


def expected(prompt: list[int], max_tokens: int, sample: int, window: int | None) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens if window is None else tokens[-window:], sample))
    return tokens[len(prompt):]


def make(windows, num_blocks, max_num_seqs=8, max_num_batched_tokens=32, caching=True, policy="fcfs", offload=0):
    bm = BlockManager(num_blocks, BS, caching, windows=windows, offload_blocks=offload)
    sched = Scheduler(bm, max_num_seqs, max_num_batched_tokens, 512, policy)
    return sched, GroupSlotWorker(sched)


WINDOWED = [((None, 6), 48), ((6,), 12)]


@pytest.mark.parametrize("windows,num_blocks", WINDOWED, ids=["hybrid", "all-sliding"])
@pytest.mark.parametrize("ahead", [False, True])
def test_long_sequences_hold_their_windows_and_match(windows, num_blocks, ahead):
    """Long prompts prefilled in chunks and long decodes; the pool is far smaller than the all-sliding model's
    contexts, and every block of every group is back at the end."""
    sched, worker = make(windows, num_blocks, max_num_batched_tokens=12)
    window = windows[-1]
    prompts = {"a": list(range(30)), "b": [5] * 17}
    max_tokens = 40 if windows[0] is None else 120  # the full group bounds the hybrid's contexts
    reqs = {rid: add(sched, rid, p, max_tokens=max_tokens) for rid, p in prompts.items()}
    run(sched, worker, ahead=ahead)
    full_window = None if windows[0] is None else window
    for rid, req in reqs.items():
        assert outputs(req)[0] == expected(prompts[rid], max_tokens, 0, full_window)
    assert 0 < worker.most_held <= blocks_held_at_most(window, BS, 10**6, 12)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


@pytest.mark.parametrize("windows,num_blocks", WINDOWED, ids=["hybrid", "all-sliding"])
@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("offload", [0, 16])
def test_preemption_and_n_samples_with_windows(windows, num_blocks, ahead, offload):
    """`offload`: a second tier keeps the blocks preemption leaves, and the recompute restores them."""
    sched, worker = make(windows, num_blocks, max_num_batched_tokens=64, offload=offload)
    full_window = None if windows[0] is None else windows[-1]
    prompts = {f"r{i}": [i] * (5 + 3 * i) for i in range(4)}
    reqs = {rid: add(sched, rid, p, max_tokens=14) for rid, p in prompts.items()}
    forked = add(sched, "n", [7, 8, 9, 10, 11, 12], max_tokens=9, n=3)
    run(sched, worker, ahead=ahead)
    assert sched.num_preemptions > 0
    for rid, req in reqs.items():
        assert outputs(req)[0] == expected(prompts[rid], 14, 0, full_window)
    assert outputs(forked) == {i: expected([7, 8, 9, 10, 11, 12], 9, i, full_window) for i in range(3)}
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
    sched.block_manager.pool.check_invariants()
    if offload:
        assert sched.block_manager.tier.restored_blocks > 0
        sched.block_manager.tier.check_invariants()


@pytest.mark.parametrize("windows", [(None, 6), (6,)], ids=["hybrid", "all-sliding"])
def test_n_samples_copy_on_write_in_every_group(windows):
    sched, worker = make(windows, 40 * len(windows))
    prompt = [7, 8, 9, 10, 11, 12]  # ends mid-block: the samples share a partial block
    req = add(sched, "n", prompt, max_tokens=20, n=3)
    run(sched, worker)
    assert any(len(b.block_copies) >= len(windows) for b in worker.batches)
    full_window = None if windows[0] is None else windows[-1]
    assert outputs(req) == {i: expected(prompt, 20, i, full_window) for i in range(3)}
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_prefix_hits_and_aborts_with_windows(policy):
    sched, worker = make((None, 6), 80, policy=policy)
    shared = list(range(1, 30))
    first = add(sched, "a", shared + [40], max_tokens=4)
    run(sched, worker)
    second = add(sched, "b", shared + [41, 42], max_tokens=4)
    add(sched, "c", list(range(50, 70)), max_tokens=30)
    for _ in range(3):
        sched.update(b := sched.schedule(), worker.execute(b))
    sched.abort("c")
    run(sched, worker)
    assert sched.block_manager.prefix_cache_hits == 28
    assert outputs(first)[0] == expected(shared + [40], 4, 0, None)
    assert outputs(second)[0] == expected(shared + [41, 42], 4, 0, None)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


def test_admission_counts_a_sliding_group_by_its_window():
    """A sequence longer than the pool holds fits it where every layer slides (it holds a window's span); where a
    group attends in full, the pool bounds the context, counting the sliding groups' spans beside it."""
    sched, _ = make((6,), 8, max_num_batched_tokens=8)
    assert sched.block_manager.max_seq_len(8) > 10**6
    add(sched, "long", [1] * 100, max_tokens=300)
    sched, _ = make((6,), 4, max_num_batched_tokens=8)  # 3 blocks cannot hold a chunk of 8 and its window
    with pytest.raises(ValueError, match="can never fit"):
        add(sched, "long", [1] * 100, max_tokens=300)
    sched, _ = make((None, 6), 15, max_num_batched_tokens=8)  # 14 blocks: 11 of the full group's, 5 sliding
    with pytest.raises(ValueError, match="needs 16 KV blocks, more than the pool's 14"):
        add(sched, "long", [1] * 40, max_tokens=2)
    assert sched.block_manager.max_seq_len(8) == 9 * BS  # 9 full blocks beside the sliding group's 5
    add(sched, "fits", [1] * 30, max_tokens=6)


# --- kernels over tables the block manager made --------------------------------------------------------------


def manager_tables(rows: list[tuple[int, int]], window: int, block_size: int, num_blocks: int) -> torch.Tensor:
    """The sliding group's block tables [R, blocks] (-1 past each row) for rows of (new tokens, context): each
    sequence computed in chunks of 16 tokens up to its new tokens, as the scheduler would run it."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False, windows=(window,))
    tables = torch.full((len(rows), max(-(-c // block_size) for _, c in rows) + 1), -1, dtype=torch.long)
    for r, (num_new, ctx) in enumerate(rows):
        seq = make_seq([r] * ctx, r)
        while seq.num_computed_tokens < ctx - num_new:
            step(bm, seq, min(16, ctx - num_new - seq.num_computed_tokens))
        assert bm.allocate_slots(seq, num_new) is not None
        tables[r, :len(seq.block_table)] = torch.tensor(seq.block_table)
    return tables


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("window", [5, 16, 40])
def test_kernels_never_read_the_placeholder(backend, window):
    """Rows of every kind over the tables a sliding group holds, whose entries before the window are the
    placeholder block: filled with NaN there, any read of it past the mask shows in the output."""
    from pagedserve.kernels import reference

    block_size, num_blocks = 16, 80
    rows = [(1, 150), (23, 23), (1, 7), (20, 90), (1, 1), (3, 130), (1, 64)]
    tables = manager_tables(rows, window, block_size, num_blocks)
    assert (tables == NULL_BLOCK).any()
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(2, num_blocks, block_size, 2, 64, generator=gen)  # [2, N, B, Hkv, D]
    kv[:, NULL_BLOCK] = 0.0
    cu = torch.tensor([0, *torch.tensor([n for n, _ in rows]).cumsum(0).tolist()])
    ctx = torch.tensor([c for _, c in rows])
    query = torch.randn(int(cu[-1]), 8, 64, generator=gen)
    expected = reference.paged_attention(query, kv, cu, ctx, tables, 0.125, window=window)
    poisoned = kv.clone()
    poisoned[:, NULL_BLOCK] = float("nan")
    if backend == "triton":  # on a GPU where there is one, else in Triton's interpreter
        pytest.importorskip("triton")
        from pagedserve.kernels.gpu.attention import paged_attention
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        args = [t.to(dev) for t in (query, poisoned, cu, ctx, tables)]
        outs = [paged_attention(*args, 0.125, window=window, split_kv=s).cpu() for s in (False, True)]
    else:
        from pagedserve.kernels.cpu import ops
        if not ops.available():
            pytest.skip("no C compiler for the CPU kernel")
        outs = [ops.paged_attention(query, poisoned, cu, ctx, tables, 0.125, window=window)]
    for out in outs:
        assert torch.isfinite(out).all(), "the placeholder block was read"
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


# --- the engine, against transformers ------------------------------------------------------------------------

# Blocks of the shared pool: Mistral's hold its 3 layers (one group), Qwen2's one layer (3 groups of one layer).
ENGINE_POOLS = {"mistral-window": 8, "qwen2-window": 48}


@pytest.fixture(scope="module", params=sorted(ENGINE_POOLS))
def windowed_model(request, tmp_path_factory):
    """A tiny Mistral (a window of 12 on every layer) and Qwen2 (40 on two of three layers), with prompts and 48
    new tokens that run far past their windows, and transformers' greedy tokens for them."""
    from tests.test_parity import PROMPT_LENS, hf_greedy, tiny_hf_model

    model = tiny_hf_model(request.param)
    config = model.config
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return request.param, path, prompts, hf_greedy(model, prompts, 48)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_windowed_models_match_transformers_in_a_pool_smaller_than_their_contexts(windowed_model,
                                                                                  async_scheduling):
    """Mistral's pool of 7 usable blocks (112 positions) runs a 215-token sequence beside seven others; both
    models preempt, fork n = 3 samples and hit the prefix cache, with transformers' tokens and every block of
    every group back."""
    from pagedserve import LLM
    from tests.test_parity import BS, pool_of

    name, path, prompts, expected = windowed_model
    llm = LLM(str(path), block_size=BS, kv_cache_memory=pool_of(path, ENGINE_POOLS[name]), max_num_batched_tokens=32,
              async_scheduling=async_scheduling, dtype="float32")  # as transformers computes (a GPU's auto: bf16)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    if name == "mistral-window":
        assert stats["num_total_blocks"] * BS < len(prompts[4]) + 48
    outs = llm.generate(prompts[:3], SamplingParams(n=3, temperature=0, max_tokens=48, ignore_eos=True))
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[e] * 3 for e in expected[:3]]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[5:6], params)] == expected[5:6]
    before = llm.stats()["prefix_cache_hits"]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[5:6], params)] == expected[5:6]  # a hit now
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > before and stats["num_free_blocks"] == stats["num_total_blocks"]
