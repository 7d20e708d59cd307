"""The worker's KV sizing: the profiling step that measures activations on CUDA runs on any device, so
its batch (the worst step the scheduler can send) is checked here on CPU."""

from __future__ import annotations

import gc
import json
import weakref

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.workers.worker import kv_budget, profile_batch
from tests.serving.app import BLOCK_BYTES


@pytest.mark.parametrize("num_tokens,max_num_seqs,block_size", [(100, 8, 16), (5, 256, 16), (2048, 256, 32)])
def test_profile_batch_is_the_largest_step(num_tokens, max_num_seqs, block_size):
    batch = profile_batch(num_tokens, max_num_seqs, block_size)
    assert batch.num_tokens == num_tokens
    assert batch.num_rows == min(num_tokens, max_num_seqs)
    assert batch.cu_seqlens_q[-1] == num_tokens and sorted(batch.cu_seqlens_q) == batch.cu_seqlens_q
    lens = [b - a for a, b in zip(batch.cu_seqlens_q, batch.cu_seqlens_q[1:], strict=False)]
    assert lens == batch.context_lens and max(lens) - min(lens) <= 1  # fresh rows, evenly spread
    # each row's whole table, in a slot of its own; the last slots, so the sampler's counts cover them all
    assert batch.slots == list(range(max_num_seqs - batch.num_rows, max_num_seqs))
    assert [(slot, start) for slot, start, _ in batch.table_updates[0]] == [(r, 0) for r in batch.slots]
    tables = [ids for _, _, ids in batch.table_updates[0]]
    blocks = [b for table in tables for b in table]
    assert sorted(blocks) == list(range(len(blocks)))  # every row its own blocks
    assert all(len(t) * block_size >= n > (len(t) - 1) * block_size for t, n in zip(tables, lens, strict=True))
    assert [s.row for s in batch.samples] == list(range(batch.num_rows))
    assert all(s.params.top_k > 0 and s.params.top_p < 1 and s.params.logprobs == 20 for s in batch.samples)
    # Penalties with their histories: the sampler's counts for every slot are allocated within the profile.
    assert all(s.params.needs_penalties and s.prompt_token_ids is not None and s.seq_id < 0 for s in batch.samples)


def test_a_profile_batch_with_speculation_verifies_every_row():
    batch = profile_batch(100, 8, 16, num_proposals=4)
    assert [len(s.proposals) for s in batch.samples] == [4] * 8
    assert [s.proposals for s in profile_batch(10, 8, 16, num_proposals=4).samples] == [[0]] * 2 + [None] * 6


@pytest.mark.parametrize("max_num_batched_tokens,rows", [(100, 8), (5, 5)])
def test_profile_step_runs_on_the_worker(tiny_random, max_num_batched_tokens, rows):
    engine = LLMEngine(EngineConfig(model=tiny_random, max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                    kv_cache_memory="1MiB"))
    worker = engine.executor.worker
    pool_before = worker.runner.kv_pool
    out = worker.profile_step()
    assert len(out.samples) == rows
    # the counts' memory for all 8 slots is allocated in the profile, even when a step holds only 5 rows
    assert worker.sampler.penalties.output_counts.shape[0] == 8
    assert all(len(s.token_ids) == 1 and len(s.top_logprobs[0]) == 20 for s in out.samples)
    assert worker.runner.kv_pool is pool_before  # the throwaway pool is not the serving one


def test_profile_step_with_speculation_verifies_on_the_worker(tiny_random):
    engine = LLMEngine(EngineConfig(model=tiny_random, max_num_seqs=8, max_num_batched_tokens=100,
                                    kv_cache_memory="1MiB", speculative_config={"method": "ngram",
                                                                                 "num_speculative_tokens": 4}))
    out = engine.executor.worker.profile_step()
    assert len(out.samples) == 8 and all(1 <= len(s.token_ids) <= 5 for s in out.samples)
    engine.shutdown()


def test_profile_step_with_a_draft_model_drafts_on_the_worker(tiny_random):
    engine = LLMEngine(EngineConfig(model=tiny_random, max_num_seqs=8, max_num_batched_tokens=100,
                                    kv_cache_memory="1MiB", speculative_config={
                                        "method": "draft_model", "model": tiny_random, "num_speculative_tokens": 4}))
    out = engine.executor.worker.profile_step()
    assert len(out.samples) == 8 and all(1 <= len(s.token_ids) <= 5 for s in out.samples)
    engine.shutdown()


def test_kv_budget():
    gib = 2**30
    # 80 GiB at 0.9 = 72 GiB, less 1 GiB weights, 2 GiB activations, 3 GiB of another process.
    assert kv_budget(80 * gib, 0.9, 1 * gib, 2 * gib, 3 * gib) == 66 * gib
    assert kv_budget(80 * gib, 0.5, 39 * gib, 2 * gib, 0) < 0  # the worker turns this into a clear error
    # Half a device each (two ranks on one GPU): 0.9 of 40 GiB, whatever the sibling rank already holds.
    assert kv_budget(80 * gib, 0.9, 1 * gib, 2 * gib, 30 * gib, share=0.5) == 33 * gib


def test_too_little_kv_memory_names_the_setting(tiny_random):
    with pytest.raises(ValueError, match=r"kv_cache_memory='100B' leaves 100 bytes .* less than one block"):
        LLMEngine(EngineConfig(model=tiny_random, kv_cache_memory="100B"))


def test_a_shut_down_engine_is_collected_even_in_a_cycle(tiny_random):
    # The engine freezes the start-up heap (itself included) out of the GC; shutdown must undo that,
    # or a reference cycle through a dropped engine would keep its model and KV pool forever.
    engine = LLMEngine(EngineConfig(model=tiny_random, kv_cache_memory="1MiB"))
    worker = weakref.ref(engine.executor.worker)
    engine.cycle = engine
    engine.shutdown()
    del engine
    gc.collect()
    assert worker() is None


def test_a_cpu_pool_holds_what_running_sequences_can_fill_up_to_a_gib(tiny_random, tmp_path):
    """By default a CPU's pool (host memory, zeroed at start) is as large as max_num_seqs sequences of max_model_len
    tokens fill in every KV-cache group, and 1 GiB where they would fill more."""
    def pool_blocks(model: str, **config) -> int:
        engine = LLMEngine(EngineConfig(model=model, **config))
        try:
            return engine.block_manager.num_total_blocks
        finally:
            engine.shutdown()

    per_sequence = -(-100 // 16)  # blocks of 16 tokens
    assert pool_blocks(tiny_random, max_num_seqs=8, max_model_len=100) == 8 * per_sequence
    assert pool_blocks(tiny_random, max_num_seqs=5000) == (1 << 30) // BLOCK_BYTES  # 5000 x 32 blocks: more
    (tmp_path / "config.json").write_text(json.dumps(dict(  # tiny_random's shape; a full layer, a sliding one
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, use_sliding_window=True, sliding_window=10, max_window_layers=1)))
    windowed = f"random:{tmp_path / 'config.json'}"  # two KV-cache groups (and a placeholder block, not counted)
    assert pool_blocks(windowed, max_num_seqs=8, max_model_len=100) == 8 * per_sequence * 2
