"""Scheduler with a model-free worker that stores token ids in a slot-addressed KV pool.

The fake worker writes each new token (and its position) into the slot its block table names,
then reads the whole context back through the block table and derives the next token from it.
A wrong block table, position, copy-on-write or prefix-cache hit changes what it reads, and
so the output; the expected output is computed without any paging at all. Like the real worker, it
keeps the block tables itself and applies each step's `table_updates`, so a wrong update (a stale
entry after copy-on-write, a slot reused too soon) shows too.

`run(..., ahead=True)` drives the scheduler as the engine does with async scheduling: the next step is
scheduled and run before the output of the step before it is applied, its tokens drawn by that step
filled in by the worker (`deferred_inputs`).
"""

from __future__ import annotations

import pickle
import random

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.lora.lora_request import LoRARequest
from pagedserve.lora.slots import AdapterSlots
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.batch import SampledTokens, StepBatch, StepOutput
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.scheduler import Scheduler
from tests.test_block_manager import OffloadWorker

VOCAB = 50


def next_token(context: list[int], sample: int) -> int:
    data = b"".join(t.to_bytes(4, "little") for t in context) + sample.to_bytes(4, "little")
    return xxhash.xxh64_intdigest(data) % VOCAB


def prompt_score(context: list[int], target: int) -> float:
    """The oracle's logprob of `target` after `context`: a function of both, so a wrong position shows."""
    data = b"".join(t.to_bytes(4, "little") for t in [*context, target])
    return -(xxhash.xxh64_intdigest(data) % 1000) / 100


def adapted_token(context: list[int], sample: int, adapter: int) -> int:
    """The oracle's draw under LoRA adapter `adapter` (0: the base model): another function of the context."""
    return next_token([*context, VOCAB + adapter] if adapter else context, sample)


def expected(prompt: list[int], max_tokens: int, sample: int, adapter: int = 0) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(adapted_token(tokens, sample, adapter))
    return tokens[len(prompt):]


class SlotWorker:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        # (position, token, adapter): K/V depend on the adapter they were computed under
        self.slots: list[tuple[int, int, int] | None] = [None] * (num_blocks * block_size)
        self.adapters: dict[int, int] = {}  # adapter slot -> the adapter id it holds
        self.batches: list[StepBatch] = []
        self.last_draws: list[int] = []  # the first draw of each sample spec of the last step
        self.tables: dict[int, list[int]] = {}  # slot -> block table
        self.offloaded = OffloadWorker()  # the second tier

    def execute(self, batch: StepBatch) -> StepOutput:
        self.batches.append(batch)
        input_ids = list(batch.input_ids)
        assert [i for i, t in enumerate(input_ids) if t == -1] == sorted(i for i, _ in batch.deferred_inputs)
        for index, sample in batch.deferred_inputs:
            input_ids[index] = self.last_draws[sample]
        bs = self.block_size
        self.offloaded.copy(batch.kv_saves, batch.kv_loads, lambda b: self.slots[b * bs:(b + 1) * bs],
                            lambda b, page: self.slots.__setitem__(slice(b * bs, (b + 1) * bs), page))
        for src, dst in batch.block_copies:
            self.slots[dst * bs:(dst + 1) * bs] = self.slots[src * bs:(src + 1) * bs]
        for slot, start, ids in batch.table_updates[0]:
            table = self.tables.setdefault(slot, [])
            assert start <= len(table), f"update of slot {slot} from {start} leaves a gap"
            table[start:] = ids  # what a freed slot held before is never read, so drop it here
        assert len(set(batch.slots)) == batch.num_rows, "two rows share a slot"
        for slot, lora in batch.lora_loads:
            self.adapters[slot] = lora.lora_int_id
        held = {b for slot in batch.slots for b in self.tables[slot]}
        assert all(dst in held for _, dst in batch.block_copies), "a copy into a block no row of the step holds"
        row_context: list[list[int]] = []
        row_adapter: list[int] = []
        for r in range(batch.num_rows):
            q = input_ids[batch.cu_seqlens_q[r]:batch.cu_seqlens_q[r + 1]]
            length = batch.context_lens[r]
            table = self.tables[batch.slots[r]]
            assert len(table) == -(-length // bs), "block table must cover exactly the context"
            adapter = self.adapters[batch.lora_slots[r]] if batch.lora_slots and batch.lora_slots[r] >= 0 else 0
            row_adapter.append(adapter)
            for i, token in enumerate(q):
                pos = length - len(q) + i
                self.slots[table[pos // bs] * bs + pos % bs] = (pos, token, adapter)
            context = []
            for pos in range(length):
                entry = self.slots[table[pos // bs] * bs + pos % bs]
                assert entry is not None and entry[0] == pos, f"slot for position {pos} holds {entry}"
                assert entry[2] == adapter, f"position {pos}: K/V of adapter {entry[2]} read under {adapter}"
                context.append(entry[1])
            row_context.append(context)
        samples = []
        for spec in batch.samples:
            ctx, adapter = row_context[spec.row], row_adapter[spec.row]
            samples.append(SampledTokens([adapted_token(ctx, spec.sample_index + i, adapter)
                                          for i in range(spec.num_samples)]))
        scored = []
        for spec in batch.prompt_logprobs:
            ctx = row_context[spec.row]
            first = batch.context_lens[spec.row] - (batch.cu_seqlens_q[spec.row + 1] - batch.cu_seqlens_q[spec.row])
            first += spec.start  # the position whose logits score target_token_ids[0]
            scored.append(SampledTokens(list(spec.target_token_ids), [
                prompt_score(ctx[:first + j + 1], t) for j, t in enumerate(spec.target_token_ids)], None))
        self.last_draws = [s.token_ids[0] for s in samples]
        return StepOutput(samples, scored)


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256,
         caching=True, policy="fcfs", max_loras=0, offload=0):
    """`max_loras`: the workers' LoRA adapter slots (0: none); `offload`: the prefix cache's second tier's blocks."""
    bm = BlockManager(num_blocks, block_size, caching, offload_blocks=offload)
    slots = AdapterSlots(max_loras) if max_loras else None
    return (Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len, policy, adapter_slots=slots),
            SlotWorker(num_blocks, block_size))


def run(sched: Scheduler, worker: SlotWorker, max_steps: int = 10_000, ahead: bool = False) -> int:
    """Step until every request ends; `ahead`: schedule each step before the previous one's output is
    applied, wherever `can_schedule_ahead` allows."""
    steps = 0
    in_flight: tuple[StepBatch, StepOutput] | None = None
    while sched.has_unfinished() or in_flight is not None:
        if in_flight is None:
            batch = sched.schedule()
            assert batch is not None, "unfinished requests but nothing scheduled: deadlock"
            in_flight = (batch, worker.execute(batch))
        batch, out = in_flight
        in_flight = None
        if ahead and sched.can_schedule_ahead(batch, late_masks=False) and (next_batch := sched.schedule()) is not None:
            in_flight = (next_batch, worker.execute(next_batch))
        sched.update(batch, out)
        # forks included, no more sequences run than the workers' slots and penalty counts are sized for
        assert sum(1 if s.request.forked else s.request.params.n for s in sched.running) <= sched.max_num_seqs
        assert sched._num_slots <= sched.max_num_seqs
        steps += 1
        assert steps < max_steps
    return steps


def add(sched, rid, prompt, max_tokens, n=1, prompt_logprobs=None, stop_token_ids=None, priority=0, adapter=0):
    lora = LoRARequest(f"adapter{adapter}", adapter, f"/adapters/{adapter}") if adapter else None
    req = Request(rid, prompt, SamplingParams(n=n, max_tokens=max_tokens, temperature=0, priority=priority,
                                              prompt_logprobs=prompt_logprobs, stop_token_ids=stop_token_ids or []),
                  lora=lora)
    sched.add_request(req)
    return req


def outputs(req: Request) -> dict[int, list[int]]:
    return {s.sample_index: s.output_token_ids for s in req.sequences}


def test_decode_feeds_last_sampled_token_at_its_position():
    sched, worker = make()
    req = add(sched, "a", [1, 2, 3, 4, 5], max_tokens=3)
    run(sched, worker)
    prefill, d1, d2 = worker.batches
    assert prefill.input_ids == [1, 2, 3, 4, 5] and prefill.context_lens == [5]
    out = req.sequences[0].output_token_ids
    # Each decode step computes exactly the token sampled last, at position = its index.
    assert d1.input_ids == [out[0]] and d1.context_lens == [6]
    assert d2.input_ids == [out[1]] and d2.context_lens == [7]
    assert out == expected([1, 2, 3, 4, 5], 3, 0)
    assert req.sequences[0].finish_reason == "length"


@pytest.mark.parametrize("ahead", [False, True])
def test_chunked_prefill_respects_budget_and_mixes_with_decode(ahead):
    sched, worker = make(max_num_batched_tokens=8)
    a = add(sched, "a", list(range(3)), max_tokens=6)
    sched.update(b := sched.schedule(), worker.execute(b))
    b_req = add(sched, "b", list(range(10, 30)), max_tokens=2)
    run(sched, worker, ahead=ahead)
    assert all(b.num_tokens <= 8 for b in worker.batches)
    mixed = [b for b in worker.batches if b.num_rows == 2]
    assert mixed, "a decode row and a prefill chunk should share a step"
    assert outputs(a)[0] == expected(list(range(3)), 6, 0)
    assert outputs(b_req)[0] == expected(list(range(10, 30)), 2, 0)


@pytest.mark.parametrize("ahead", [False, True])
def test_preemption_by_recompute_gives_same_tokens(ahead):
    sched, worker = make(num_blocks=10, block_size=4, max_num_batched_tokens=64)
    prompts = {f"r{i}": [i] * (5 + i) for i in range(4)}
    reqs = {rid: add(sched, rid, p, max_tokens=12) for rid, p in prompts.items()}
    run(sched, worker, ahead=ahead)
    assert sched.num_preemptions > 0
    for rid, req in reqs.items():
        assert outputs(req)[0] == expected(prompts[rid], 12, 0)
    assert sched.block_manager.num_free_blocks == 10


@pytest.mark.parametrize("ahead", [False, True])
def test_prefix_cache_hits_reuse_blocks_with_same_result(ahead):
    sched, worker = make()
    shared = list(range(1, 21))
    first = add(sched, "a", shared + [30], max_tokens=4)
    run(sched, worker, ahead=ahead)
    second = add(sched, "b", shared + [31, 32], max_tokens=4)
    run(sched, worker, ahead=ahead)
    assert sched.block_manager.prefix_cache_hits == 20
    assert worker.batches[-4].input_ids == [31, 32]  # only the new tokens were computed
    assert outputs(first)[0] == expected(shared + [30], 4, 0)
    assert outputs(second)[0] == expected(shared + [31, 32], 4, 0)


@pytest.mark.parametrize("ahead", [False, True])
def test_n_samples_fork_and_copy_on_write(ahead):
    sched, worker = make()
    prompt = [7, 8, 9, 10, 11, 12]  # ends mid-block: the forks share a partial block
    req = add(sched, "a", prompt, max_tokens=5, n=3)
    run(sched, worker, ahead=ahead)
    assert any(b.block_copies for b in worker.batches)
    assert worker.batches[0].samples[0].num_samples == 3
    for i in range(3):
        assert outputs(req)[i] == expected(prompt, 5, i)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


def test_abort_frees_blocks_at_once():
    sched, worker = make()
    add(sched, "a", list(range(20)), max_tokens=50)
    add(sched, "b", list(range(5)), max_tokens=50)
    for _ in range(3):
        sched.update(b := sched.schedule(), worker.execute(b))
    sched.abort("a")
    assert all(s.request.request_id != "a" for s in sched.running)
    sched.abort("b")
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
    assert sched.abort("unknown") is None


def test_update_reads_the_step_from_the_batch_alone():
    """The batch is the whole record of a step: a copy that went through pickling (as to a Ray worker and
    back) drives update exactly as the original would."""
    sched, worker = make(max_num_batched_tokens=8)
    a = add(sched, "a", list(range(10)), max_tokens=3)
    b = add(sched, "b", list(range(20, 23)), max_tokens=3, n=2)
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.update(pickle.loads(pickle.dumps(batch)), worker.execute(batch))
    assert outputs(a) == {0: expected(list(range(10)), 3, 0)}
    assert outputs(b) == {i: expected(list(range(20, 23)), 3, i) for i in range(2)}
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


def test_abort_while_step_runs_is_ignored_by_update():
    sched, worker = make()
    add(sched, "a", list(range(6)), max_tokens=5)
    batch = sched.schedule()
    out = worker.execute(batch)
    sched.abort("a")
    assert sched.update(batch, out) == []
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


def test_admission_rejects_what_can_never_fit():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_tokens"):
        add(sched, "a", [1] * 10, max_tokens=10)  # 20 tokens need 5 blocks > 4
    with pytest.raises(ValueError, match="max_model_len"):
        add(sched, "b", [1] * 65, max_tokens=1)
    with pytest.raises(ValueError, match="max_model_len"):
        add(sched, "c", [1] * 60, max_tokens=10)
    add(sched, "d", [1] * 8, max_tokens=8)
    with pytest.raises(ValueError, match="request_id"):
        add(sched, "d", [1], max_tokens=1)
    assert len(sched.waiting) == 1


def test_max_num_seqs_caps_rows_per_step():
    sched, worker = make(max_num_seqs=2)
    for i in range(5):
        add(sched, f"r{i}", [i + 1] * 3, max_tokens=3)
    run(sched, worker)
    assert max(b.num_rows for b in worker.batches) == 2


@pytest.mark.parametrize("ahead", [False, True])
def test_forks_count_against_max_num_seqs(ahead):
    sched, worker = make(max_num_seqs=4)
    reqs = [add(sched, f"r{i}", [i + 1] * 5, max_tokens=4, n=3) for i in range(3)]
    with pytest.raises(ValueError, match="n=5 .*max_num_seqs=4"):
        add(sched, "too-many", [1, 2], max_tokens=2, n=5)
    run(sched, worker, ahead=ahead)  # checks the cap after every step
    for i, req in enumerate(reqs):
        assert outputs(req) == {s: expected([i + 1] * 5, 4, s) for s in range(3)}
    # one request's 3 samples at a time: a second request's fork would make 6 sequences
    assert max(b.num_rows for b in worker.batches) == 3


@pytest.mark.parametrize("ahead", [False, True])
def test_stop_token_and_eos(ahead):
    sched, worker = make()
    prompt = [3, 4, 5]
    full = expected(prompt, 10, 0)
    stop_at = full[4]
    cut = full.index(stop_at) + 1
    req = Request("a", prompt, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))
    sched.add_request(req)
    eos = Request("b", prompt, SamplingParams(max_tokens=10, temperature=0), eos_token_ids=frozenset({stop_at}))
    sched.add_request(eos)
    ignore = Request("c", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                     eos_token_ids=frozenset({stop_at}))
    sched.add_request(ignore)
    run(sched, worker, ahead=ahead)
    assert outputs(req)[0] == full[:cut] and req.sequences[0].finish_reason == "stop"
    assert outputs(eos)[0] == full[:cut] and eos.sequences[0].finish_reason == "stop"
    assert outputs(ignore)[0] == full and ignore.sequences[0].finish_reason == "length"


def step(sched, worker):
    batch = sched.schedule()
    sched.update(batch, worker.execute(batch))
    return batch


def rows(sched, batch) -> list[str]:
    return [sched.seqs[i].request.request_id if i in sched.seqs else "done" for i in batch.seq_ids]


@pytest.mark.parametrize("ahead", [False, True])
def test_priority_admits_the_most_urgent_first_and_preempts_the_least_urgent_for_it(ahead):
    sched, worker = make(max_num_seqs=2, policy="priority")
    low = [add(sched, f"low{i}", [i] * 5, max_tokens=12, priority=5) for i in range(2)]
    step(sched, worker)
    assert sched.num_preemptions == 0
    late_low = add(sched, "late_low", [7] * 5, max_tokens=4, priority=5)
    urgent = add(sched, "urgent", [9] * 5, max_tokens=4, priority=-1)
    batch = step(sched, worker)
    # the seat goes to the urgent request: the low one admitted last gives way; the equally low one waits
    assert sorted(rows(sched, batch)) == ["low0", "urgent"]
    assert sched.num_preemptions == 1
    assert [s.request.request_id for s in sched.waiting] == ["low1", "late_low"]
    run(sched, worker, ahead=ahead)
    for req, prompt, n in [(low[0], [0] * 5, 12), (low[1], [1] * 5, 12), (late_low, [7] * 5, 4),
                           (urgent, [9] * 5, 4)]:
        assert outputs(req)[0] == expected(prompt, n, 0)
    assert sched.block_manager.num_free_blocks == 64


def test_a_sequence_preempted_for_an_urgent_one_leaves_no_rows_or_copies_in_the_step():
    sched, worker = make(block_size=4, max_num_seqs=2, policy="priority")
    low = add(sched, "low", [1] * 5, max_tokens=6, n=2, priority=1)
    step(sched, worker)  # prefill; the draw forks it into two samples sharing the partial second block
    urgent = add(sched, "urgent", [2] * 5, max_tokens=3, n=2, priority=0)
    batch = step(sched, worker)
    # both samples had their rows, and the first its copy-on-write of the shared block, before the urgent
    # request (two seats) preempted them: none of it may reach the worker
    assert rows(sched, batch) == ["urgent"] and batch.block_copies == []
    assert sched.num_preemptions == 2
    run(sched, worker)
    assert outputs(low) == {i: expected([1] * 5, 6, i) for i in range(2)}
    assert outputs(urgent) == {i: expected([2] * 5, 3, i) for i in range(2)}


def test_priority_preempts_for_blocks_and_orders_the_queue():
    # 6 blocks of 4: two 10-token sequences fill the pool
    sched, worker = make(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, policy="priority")
    a = add(sched, "a", [1] * 9, max_tokens=3, priority=2)
    b = add(sched, "b", [2] * 9, max_tokens=3, priority=1)
    batch = step(sched, worker)
    assert rows(sched, batch) == ["b", "a"]  # running in order of urgency
    c = add(sched, "c", [3] * 9, max_tokens=3, priority=0)
    d = add(sched, "d", [4] * 9, max_tokens=3, priority=3)  # less urgent than all: waits, preempts nobody
    batch = step(sched, worker)
    assert "c" in rows(sched, batch) and "a" not in rows(sched, batch)
    assert [s.request.request_id for s in sched.waiting] == ["a", "d"]
    run(sched, worker)
    for req, tok in [(a, 1), (b, 2), (c, 3), (d, 4)]:
        assert outputs(req)[0] == expected([tok] * 9, 3, 0)
    assert sched.block_manager.num_free_blocks == 6


def test_first_come_first_served_refuses_priorities():
    sched, _ = make()
    with pytest.raises(ValueError, match="priority=1 needs scheduling_policy='priority'"):
        add(sched, "a", [1, 2], max_tokens=2, priority=1)
    with pytest.raises(ValueError, match="scheduling_policy='lifo' must be one of"):
        make(policy="lifo")
    with pytest.raises(ValueError, match="priority=1.5 must be an integer"):
        SamplingParams(priority=1.5)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 6),
    caching=st.booleans(),
    ahead=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    max_loras=st.sampled_from([0, 0, 1, 2]),
    offload=st.sampled_from([0, 0, 2, 16]),
)
def test_random_workloads_finish_correctly_and_return_all_blocks(data, num_blocks, block_size, budget,
                                                                 max_num_seqs, caching, ahead, policy, max_loras,
                                                                 offload):
    """`max_loras`: requests run with LoRA adapters (of four, and the base model) in that many slots; `offload`:
    blocks of the prefix cache's second tier."""
    check_random_workload(data.draw(st.integers(0, 2**16)), data.draw(st.integers(1, 8)), num_blocks, block_size,
                          budget, max_num_seqs, caching, ahead, policy, max_loras, offload * caching)


def test_a_sequence_preempted_in_the_step_that_copied_its_last_block_recomputes_it():
    """Found by the test above: a forked sample preempted by a more urgent request in the step whose
    copy-on-write gave it a block of its own; that copy is dropped with it, so the block holds nothing and must
    not be offered as the sample's computed tail when it is admitted again."""
    check_random_workload(1682, 6, num_blocks=9, block_size=8, budget=23, max_num_seqs=5, caching=True, ahead=False,
                          policy="priority")


def check_random_workload(seed: int, num_requests: int, num_blocks: int, block_size: int, budget: int,
                          max_num_seqs: int, caching: bool, ahead: bool, policy: str, max_loras: int = 0,
                          offload: int = 0) -> None:
    sched, worker = make(num_blocks, block_size, max_num_seqs, budget, max_model_len=num_blocks * block_size,
                         caching=caching, policy=policy, max_loras=max_loras, offload=offload)
    rng = random.Random(seed)
    stem = [rng.randrange(VOCAB) for _ in range(3 * block_size)]
    reqs = []
    for i in range(num_requests):
        prompt = stem[: rng.randrange(len(stem) + 1)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
        max_tokens = rng.randrange(1, 12)
        n = min(rng.choice([1, 1, 2, 3]), max_num_seqs)
        if block_size * num_blocks < len(prompt) + max_tokens:
            continue
        scored = rng.choice([None, None, 0])
        stop = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 3]))]  # ends some outputs early
        priority = rng.randrange(3) if policy == "priority" else 0
        adapter = rng.randrange(5) if max_loras else 0
        reqs.append((add(sched, f"r{i}", prompt, max_tokens, n, scored, stop, priority, adapter), prompt,
                     max_tokens))
        if rng.random() < 0.3:  # arrivals between steps
            if (b := sched.schedule()) is not None:
                sched.update(b, worker.execute(b))
    run(sched, worker, ahead=ahead)
    for req, prompt, max_tokens in reqs:
        outs = outputs(req)
        assert len(outs) == req.params.n
        for i, toks in outs.items():
            want = expected(prompt, max_tokens, i, req.lora.lora_int_id if req.lora else 0)
            ends = [j for j, t in enumerate(want) if t in req.params.stop_token_ids]
            assert toks == (want[:ends[0] + 1] if ends else want)
        if req.params.prompt_logprobs is not None:  # every prompt token scored once, at its own position,
            # through chunks, preemption and a cached prefix
            assert [e.token_id for e in req.prompt_logprobs] == prompt
            assert [e.logprob for e in req.prompt_logprobs] == [None] + [
                prompt_score(prompt[:t], prompt[t]) for t in range(1, len(prompt))]
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    bm.pool.check_invariants()
    if bm.tier is not None:
        bm.tier.check_invariants()
