"""K/V moved between two engines (two model replicas) in one process: a prompt's cached blocks exported by the one
that computed them and imported by the other, which then computes only what follows, with the tokens recompute
gives; transfers that cannot be used (other blocks, pages of another layout, a request that never runs) fall back to
recompute; at the end every block is back and no worker holds pages on either side."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.scheduler.prefix_transfer import PrefixExport

# tiny_random's block: 2 layers x K and V x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 8 KiB; 40 in the pool
CPU = dict(device="cpu", dtype="float32", kv_cache_memory="320KiB")
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Four prompts of 150 tokens: 9 full blocks each, the last token computed whatever is cached."""
    rng = random.Random(1)
    return [[rng.randrange(1000, 20000) for _ in range(150)] for _ in range(4)]


@pytest.fixture(scope="module")
def expected(tiny_random, prompts) -> list[list[tuple[int, float]]]:
    """Each prompt's greedy tokens and logprobs (which tell K/V apart where a tiny model's tokens may not), computed
    whole."""
    llm = LLM(tiny_random, **CPU)
    outs = answers(llm, prompts)
    llm.shutdown()
    return outs


@pytest.fixture(scope="module")
def source(tiny_random, prompts) -> LLM:
    """The replica that computed every prompt: its prefix cache holds their full blocks."""
    llm = LLM(tiny_random, **CPU)
    answers(llm, prompts)
    yield llm
    llm.shutdown()


def answers(llm: LLM, prompts: list[list[int]], imports=None, params=GREEDY) -> list[list[tuple[int, float]]]:
    """The prompts run together in `llm`'s engine, each with its import (if any)."""
    engine = llm.llm_engine
    ids = [engine.add_request({"prompt_token_ids": p}, params, kv_import=imports[i] if imports else None)
           for i, p in enumerate(prompts)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [[(t, lp.logprob) for t, lp in zip(done[i].token_ids, done[i].logprobs, strict=True)] for i in ids]


def export(llm: LLM, prompt: list[int], **kwargs) -> PrefixExport:
    engine = llm.llm_engine
    export_id = engine.export_prefix(prompt, **kwargs)
    while export_id not in engine.exports_done:
        engine.step()  # a step without rows carries it where nothing else runs
    result = engine.exports_done.pop(export_id)
    assert isinstance(result, PrefixExport), result
    return result


def assert_nothing_held(llm: LLM) -> None:
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        engine.step()  # the releases still due
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert engine.executor.worker.runner.transfer.num_held == 0
    assert not engine.scheduler.transfers.staged and not engine.exports_done


def test_an_imported_prefix_gives_the_tokens_recompute_gives(tiny_random, prompts, expected, source):
    exported = export(source, prompts[0])
    assert exported.first_block == 0 and len(exported.hashes) == 9
    assert exported.pages[0][0].shape == (9, 2, 2, 16, 2, 16)  # one rank, one pool: [blocks, layers, K/V, B, H, D]
    assert source.llm_engine.stats()["kv_transfer_exports"] == 1

    llm = LLM(tiny_random, **CPU)
    kv_import = llm.llm_engine.import_prefix(exported, prompts[0])
    assert kv_import is not None
    assert answers(llm, prompts[:1], [kv_import]) == expected[:1]
    stats = llm.stats()
    assert stats["kv_transfer_hits"] == stats["prefix_cache_hits"] == 9 * 16
    assert stats["kv_transfer_imports"] == 1 and stats["kv_transfer_failures"] == 0
    assert_nothing_held(llm)
    assert_nothing_held(source)

    # The imported K/V are what the step reads: with the pages zeroed the same prompt answers otherwise.
    zeroed = PrefixExport(exported.first_block, exported.hashes, [[torch.zeros_like(p) for p in exported.pages[0]]])
    other = LLM(tiny_random, **CPU)
    assert answers(other, prompts[:1], [other.llm_engine.import_prefix(zeroed, prompts[0])]) != expected[:1]
    other.shutdown()
    llm.shutdown()


def test_a_replica_fetches_only_the_blocks_it_lacks_while_others_prefill_in_chunks(tiny_random, prompts, expected,
                                                                                   source):
    """The receiver holds the first 4 blocks of each prompt (an earlier, shorter prompt); it fetches the other 5
    and computes the rest in chunks of 32 tokens beside the other prompts, its pool too small for all at once."""
    llm = LLM(tiny_random, **dict(CPU, kv_cache_memory="200KiB", max_num_batched_tokens=32))
    answers(llm, [p[:70] for p in prompts])
    imports = []
    for p in prompts:
        exported = export(source, p, first_block=4)
        assert (exported.first_block, len(exported.hashes)) == (4, 5)
        imports.append(llm.llm_engine.import_prefix(exported, p))
    assert answers(llm, prompts, imports) == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert 0 < stats["kv_transfer_hits"] <= 4 * 5 * 16
    assert_nothing_held(llm)
    llm.shutdown()


def test_transfers_that_cannot_be_used_fall_back_to_recompute(tiny_random, prompts, expected, source):
    llm = LLM(tiny_random, **CPU)
    engine = llm.llm_engine
    # Another prompt's blocks: refused before anything is staged.
    assert engine.import_prefix(export(source, prompts[1]), prompts[0]) is None
    # Pages of another layout (half the heads: a rank of another tensor-parallel split) are refused by the workers.
    exported = export(source, prompts[0])
    halved = PrefixExport(exported.first_block, exported.hashes, [[p[:, :, :, :, :1] for p in exported.pages[0]]])
    assert engine.import_prefix(halved, prompts[0]) is None
    assert engine.stats()["kv_transfer_failures"] == 2
    # A request that never runs releases its import: aborted while waiting, or refused as it is made.
    aborted = engine.import_prefix(exported, prompts[0])
    engine.add_request({"prompt_token_ids": prompts[0]}, GREEDY, request_id="gone", kv_import=aborted)
    engine.abort_request("gone")
    refused = engine.import_prefix(exported, prompts[0])
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=10**6), kv_import=refused)
    assert engine.executor.worker.runner.transfer.num_held == 2
    assert_nothing_held(llm)
    assert answers(llm, prompts[:1]) == expected[:1]  # computed whole
    assert engine.stats()["kv_transfer_hits"] == 0
    llm.shutdown()


def test_an_export_reads_blocks_the_second_tier_holds(tiny_random, prompts, expected, tmp_path):
    """A source whose pool let the prompt's blocks go to its second tier exports them from there."""
    holder = LLM(tiny_random, **dict(CPU, kv_cache_memory="160KiB", kv_offload_disk="1MiB",
                                     kv_offload_dir=str(tmp_path)))
    answers(holder, prompts[:1])
    answers(holder, prompts[1:])  # 27 more blocks through a pool of 20: the first prompt's are in the tier now
    exported = export(holder, prompts[0])
    assert len(exported.hashes) == 9
    assert not set(exported.hashes) & set(holder.llm_engine.block_manager.pool.cached_hashes())
    llm = LLM(tiny_random, **CPU)
    assert answers(llm, prompts[:1], [llm.llm_engine.import_prefix(exported, prompts[0])]) == expected[:1]
    assert llm.stats()["kv_transfer_hits"] == 9 * 16
    holder.shutdown()
    llm.shutdown()
