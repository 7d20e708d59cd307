"""The prefix cache's second tier on a CPU: blocks evicted from the KV pool kept in a file on local disk, restored on
a hit instead of recomputed, with the tokens recompute gives; and its settings refused by name."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.scheduler.block_manager import prefix_hashes

# tiny_random's block: 2 layers x K and V x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 8 KiB; 20 in the pool
POOL = "160KiB"
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=0)
CPU = dict(device="cpu", dtype="float32", kv_cache_memory=POOL)  # the CPU path, even where there is a GPU


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Eight prompts of 150 tokens (9 full blocks each): 72 blocks, nearly four times the pool."""
    rng = random.Random(0)
    return [[rng.randrange(1000, 20000) for _ in range(150)] for _ in range(8)]


def one_at_a_time(llm: LLM, prompts: list[list[int]], rounds: int) -> list[list[tuple[int, float]]]:
    """Each prompt alone, round after round (by a prompt's next turn the others have evicted its blocks): its
    greedy tokens with their logprobs, which tell K/V apart where a tiny random model's tokens may not."""
    outs = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0] for _ in range(rounds) for p in prompts]
    return [[(t, lp.logprob) for t, lp in zip(out.token_ids, out.logprobs, strict=True)] for out in outs]


def test_restored_blocks_give_the_tokens_recompute_gives(tiny_random, prompts, tmp_path):
    plain = LLM(tiny_random, **CPU)
    expected = one_at_a_time(plain, prompts, rounds=3)
    assert plain.stats()["prefix_cache_hits"] == 0  # the pool alone keeps none of them
    plain.shutdown()

    llm = LLM(tiny_random, kv_offload_disk="1MiB", kv_offload_dir=str(tmp_path), **CPU)
    assert one_at_a_time(llm, prompts, rounds=3) == expected
    stats = llm.stats()
    assert stats["offload_total_blocks"] == 128 and stats["offload_used_blocks"] == 72
    # Rounds 2 and 3 find every full block of every prompt, all but the last in the tier (the pool holds the last
    # prompt's), each restored block counted once per admission.
    assert stats["offload_hits"] == stats["offload_restored_blocks"] * 16 >= 2 * 7 * 9 * 16
    assert stats["prefix_cache_hits"] == 2 * 8 * 9 * 16
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    # what a prefix-aware router matches: every prompt's full blocks, wherever they are
    assert set(llm.llm_engine.cached_block_hashes()) >= set(prefix_hashes(prompts[0], 16))
    assert list(tmp_path.iterdir()) == []  # the tier's file is unlinked once mapped: nothing left behind

    # The restored K/V are what the steps read: with the tier's copies zeroed, the same prompts answer otherwise.
    store = llm.llm_engine.executor.worker.runner.offload
    store.stores[0].zero_()
    assert one_at_a_time(llm, prompts[:4], rounds=1) != expected[:4]
    llm.shutdown()


def test_a_batch_with_chunks_preemption_and_samples_matches_the_plain_pool(tiny_random, prompts, tmp_path):
    """All prompts at once, two seeded samples each, prefilled in chunks of 64 tokens, preempted for room: the
    same tokens with the tier as without it, and every block back at the end."""
    params = [SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=i) for i in range(len(prompts))]
    batch = [{"prompt_token_ids": p} for p in prompts]
    settings = dict(CPU, max_num_batched_tokens=64)
    plain = LLM(tiny_random, **settings)
    expected = [[c.token_ids for c in out.outputs] for _ in range(2) for out in plain.generate(batch, params)]
    plain.shutdown()
    llm = LLM(tiny_random, kv_offload_disk="1MiB", kv_offload_dir=str(tmp_path), **settings)
    got = [[c.token_ids for c in out.outputs] for _ in range(2) for out in llm.generate(batch, params)]
    stats = llm.stats()
    llm.shutdown()
    assert got == expected
    assert stats["num_preemptions"] > 0 and stats["offload_restored_blocks"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_slot_that_holds_another_block_fails_the_step_and_the_engine_goes_on(tiny_random, prompts, tmp_path):
    """A restore checks the slot's hash: a slot that holds another block fails the step (every request in it ends
    with the error) rather than give wrong K/V; the engine forgets both tiers and answers the next requests."""
    llm = LLM(tiny_random, kv_offload_disk="1MiB", kv_offload_dir=str(tmp_path), **CPU)
    expected = one_at_a_time(llm, prompts[:4], rounds=1)
    store = llm.llm_engine.executor.worker.runner.offload
    store.hashes = [None if h is None else h ^ 1 for h in store.hashes]
    with pytest.raises(RuntimeError, match=r"KV offload slot \d+ holds the block of hash"):
        one_at_a_time(llm, prompts[:1], rounds=1)
    assert llm.stats()["offload_used_blocks"] == 0  # forgotten: the slots' bookkeeping is not trusted
    assert one_at_a_time(llm, prompts[:4], rounds=2) == expected * 2  # recomputed, then kept and restored anew
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
    llm.shutdown()


@pytest.mark.parametrize("settings,message", [
    (dict(kv_offload_disk="1GiB", kv_offload_memory="1GiB"), "both set"),
    (dict(kv_offload_disk="lots"), "kv_offload_disk='lots' is not a size"),
    (dict(kv_offload_memory=0), "kv_offload_memory=0 must be a size above 0"),
    (dict(kv_offload_memory="1GiB", device="cpu"), "on device='cpu' the pool is host memory already"),
    (dict(kv_offload_dir="/tmp/x"), "kv_offload_dir='/tmp/x' needs kv_offload_disk"),
    (dict(kv_offload_disk="1GiB", enable_prefix_caching=False), "kv_offload_disk keeps the prefix cache's blocks"),
])
def test_offload_settings_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_a_tier_smaller_than_a_block_or_larger_than_the_disk_is_refused_by_name(tiny_random, tmp_path):
    with pytest.raises(ValueError, match=r"kv_offload_disk='4KiB' holds no block of 16 tokens \(8192 bytes\)"):
        LLM(tiny_random, kv_offload_disk="4KiB", kv_offload_dir=str(tmp_path), **CPU)
    too_much = shutil.disk_usage(tmp_path).free + 2**30
    with pytest.raises(ValueError, match=rf"kv_offload_disk={too_much} is more than the .* GiB free in {tmp_path}"):
        LLM(tiny_random, kv_offload_disk=too_much, kv_offload_dir=str(tmp_path), **CPU)


def test_a_draft_models_blocks_are_kept_and_restored_with_the_models(tiny_random, prompts, tmp_path):
    """A draft model's pool has the model's block ids: the tier keeps and restores its K/V too. A draft equal to
    the model then has every proposal accepted after a restore, as it would after a recompute."""
    draft = {"method": "draft_model", "model": tiny_random, "num_speculative_tokens": 3}
    llm = LLM(tiny_random, device="cpu", dtype="float32", kv_cache_memory="320KiB", speculative_config=draft,
              kv_offload_disk="2MiB", kv_offload_dir=str(tmp_path))
    outs = one_at_a_time(llm, prompts, rounds=2)
    stats = llm.stats()
    runner = llm.llm_engine.executor.worker.runner
    cached = [b.block_id for b in llm.llm_engine.block_manager.pool.blocks if b.block_hash is not None]
    # the draft's weights are the model's: its K/V of a block are the model's, restored or computed
    same = [torch.equal(runner.kv_pool[:, :, b], runner.draft.kv_pool[:, :, b]) for b in cached]
    llm.shutdown()
    assert outs[8:] == outs[:8]
    assert stats["offload_restored_blocks"] >= 7 * 9 and stats["spec_acceptance_rate"] == 1.0
    assert len(cached) > 9 and all(same)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory beside a CUDA pool")
def test_pinned_host_memory_beside_a_cuda_pool(tiny_random, prompts):
    """The GPU's tier: copies queued on the step's stream into and out of pinned host memory; greedy tokens as the
    pool alone gives them (logprobs may differ in their last bits: a CUDA prefill is not batch-invariant)."""
    settings = dict(device="cuda", dtype="float32", kv_cache_memory=POOL, cuda_graphs=True)
    plain = LLM(tiny_random, **settings)
    expected = [[t for t, _ in out] for out in one_at_a_time(plain, prompts, rounds=2)]
    plain.shutdown()
    llm = LLM(tiny_random, kv_offload_memory="1MiB", **settings)
    got = [[t for t, _ in out] for out in one_at_a_time(llm, prompts, rounds=2)]
    stats = llm.stats()
    assert llm.llm_engine.executor.worker.runner.offload.stores[0].is_pinned()
    llm.shutdown()
    assert got == expected and stats["offload_restored_blocks"] >= 7 * 9
