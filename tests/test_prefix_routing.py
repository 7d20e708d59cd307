"""What a replica publishes of its prefix cache, and how the router reads it: the chained hashes the router
computes from a prompt are the ones the block manager files its blocks under."""

from __future__ import annotations

import random
import warnings

import pytest

with warnings.catch_warnings():  # Ray Serve's own pydantic deprecation warnings, at its import: not ours
    warnings.simplefilter("ignore", DeprecationWarning)
    import ray.serve  # noqa: F401

from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.block_manager import BlockManager, prefix_hashes
from pagedserve.scheduler.request import Request, Sequence
from pagedserve.serving.prefix_router import PrefixRouting, cached_mask, leading, summarize

BS = 4


def _cache(bm: BlockManager, token_ids: list[int]) -> None:
    """Run a prompt through the block manager as the scheduler would, computing it whole, then free it."""
    seq = Sequence(0, Request("r", token_ids, SamplingParams()), list(token_ids), sample_index=0)
    cached = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, len(token_ids) - cached.num_tokens, cached) is not None
    seq.num_computed_tokens = len(token_ids)
    bm.cache_full_blocks(seq)
    bm.free(seq)


def test_the_router_finds_the_blocks_the_block_manager_cached():
    rng = random.Random(0)
    bm = BlockManager(64, BS)
    conversation = [rng.randrange(50_000) for _ in range(5 * BS + 2)]  # 5 full blocks and 2 tokens
    _cache(bm, conversation)
    summary = summarize(bm.pool.cached_hashes())
    assert len(summary) == 4 * 5  # 4 bytes a block

    next_turn = conversation + [rng.randrange(50_000) for _ in range(3 * BS)]
    assert leading(cached_mask(summary, prefix_hashes(next_turn, BS))) == 5
    # the same tokens after a different first block share nothing: the hashes are chained
    other = [conversation[0] + 1] + conversation[1:]
    assert leading(cached_mask(summary, prefix_hashes(other, BS))) == 0
    # a prompt diverging in its third block shares two
    diverged = conversation[:2 * BS] + [t + 1 for t in conversation[2 * BS:]]
    assert leading(cached_mask(summary, prefix_hashes(diverged, BS))) == 2
    # a block the pool evicted (allocated to something else) is no longer published
    for _ in range(64):
        bm.pool.allocate()
    assert leading(cached_mask(summarize(bm.pool.cached_hashes()), prefix_hashes(next_turn, BS))) == 0


def test_the_router_hashes_a_salted_prompt_as_the_block_manager_files_it():
    from types import SimpleNamespace

    from pagedserve.serving.prefix_router import ROUTED_METHOD, PrefixAwareRouter

    bm = BlockManager(64, BS)
    prompt = list(range(3 * BS))
    seq = Sequence(0, Request("r", prompt, SamplingParams(cache_salt="s1")), list(prompt), sample_index=0)
    assert bm.allocate_slots(seq, len(prompt)) is not None
    seq.num_computed_tokens = len(prompt)
    bm.cache_full_blocks(seq)
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router.block_size = BS

    def pending(salt):
        return SimpleNamespace(metadata=SimpleNamespace(call_method=ROUTED_METHOD),
                               args=[prompt, SamplingParams(cache_salt=salt), "rid"])

    assert router.prompt_hashes(pending("s1")) == seq.block_hashes == prefix_hashes(prompt, BS, "s1")
    assert not set(router.prompt_hashes(pending("s2"))) & set(seq.block_hashes)
    assert not set(router.prompt_hashes(pending(None))) & set(seq.block_hashes)


def test_prefix_hashes_cover_full_blocks_only():
    assert prefix_hashes(list(range(BS - 1)), BS) == []
    hashes = prefix_hashes(list(range(2 * BS + 1)), BS)
    assert len(hashes) == 2 and hashes == prefix_hashes(list(range(2 * BS)), BS)
    assert cached_mask(b"", hashes).tolist() == [False, False]


def test_prefix_routing_settings():
    assert PrefixRouting.parse(None) == PrefixRouting.parse(True) == PrefixRouting()
    assert PrefixRouting.parse(False) is None
    assert PrefixRouting.parse({"imbalance_threshold": 2}).imbalance_threshold == 2
    with pytest.raises(ValueError, match=r"prefix_routing has unknown settings \['threshold'\]"):
        PrefixRouting.parse({"threshold": 2})
    with pytest.raises(ValueError, match="prefix_routing.imbalance_threshold=-1 must be"):
        PrefixRouting.parse({"imbalance_threshold": -1})
    with pytest.raises(ValueError, match="prefix_routing.stats_period_s=0 must be > 0"):
        PrefixRouting.parse({"stats_period_s": 0})
    with pytest.raises(ValueError, match="prefix_routing.memory_s='30' must be > 0"):
        PrefixRouting.parse({"memory_s": "30"})
    with pytest.raises(ValueError, match=r"prefix_routing.transfer='no' must be one of \(None, True, False, 'alw"):
        PrefixRouting.parse({"transfer": "no"})
    with pytest.raises(ValueError, match="prefix_routing='yes' must be true, false or a mapping"):
        PrefixRouting.parse("yes")


def test_a_request_with_an_adapter_prefers_a_replica_holding_it_within_the_imbalance_rule():
    """Among replicas holding as much of its prefix, an adapter's request goes to one whose workers hold the
    adapter (published, or sent there lately), unless its queue is too much longer than the least loaded."""
    import asyncio
    from types import SimpleNamespace

    from pagedserve.lora.lora_request import LoRARequest
    from pagedserve.serving.prefix_router import ROUTED_METHOD, PrefixAwareRouter

    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router.block_size, router.imbalance_threshold, router.memory_s, router.transfer = BS, 2, 30.0, False
    router._remembered, router._in_flight, router._adapters_sent = {}, {}, {}
    sql = LoRARequest("sql", 7, "/adapters/sql")

    def replica(name: str, adapters: list[int]):
        return SimpleNamespace(replica_id=name, max_ongoing_requests=100, routing_stats={"adapters": adapters})

    def choose(replicas, queues: dict[str, int], lora) -> str:
        async def probe(candidates, _):
            return [(r, queues[r.replica_id]) for r in candidates]
        router._probe_queue_lens = probe
        request = SimpleNamespace(metadata=SimpleNamespace(call_method=ROUTED_METHOD),
                                  args=[[1, 2], SamplingParams(), "rid", False, lora],
                                  routing_context=SimpleNamespace(should_backoff=False))
        return asyncio.run(router.choose_replicas(replicas, request))[0][0].replica_id

    a, b = replica("a", []), replica("b", [7])
    assert choose([a, b], {"a": 0, "b": 2}, sql) == "b"  # within the threshold: the one holding it
    assert choose([a, b], {"a": 0, "b": 3}, sql) == "a"  # too busy: the adapter is loaded elsewhere
    # a replica the adapter was just sent to counts as holding it before its stats say so
    router.on_request_routed(SimpleNamespace(metadata=SimpleNamespace(call_method=ROUTED_METHOD),
                                             args=[[1], SamplingParams(), "r2", False, sql]), "a", None)
    assert choose([a, replica("c", [])], {"a": 2, "c": 0}, sql) == "a"


def test_a_request_sent_past_a_busy_holder_names_it_and_an_export_goes_to_the_replica_it_names():
    """With transfers on, the replica chosen instead of the one caching more of the prompt learns which one that is
    (`kv_source`), and the export it then asks for is routed to exactly that replica (or to none, once it is gone)."""
    import asyncio
    from dataclasses import dataclass
    from types import SimpleNamespace

    from pagedserve.serving.prefix_router import EXPORT_METHOD, ROUTED_METHOD, KVSource, PrefixAwareRouter

    @dataclass(frozen=True)
    class ReplicaID:
        unique_id: str

    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router.initialize_state(BS, imbalance_threshold=0, memory_s=30.0, transfer=True)
    prompt = list(range(4 * BS + 1))
    hashes = prefix_hashes(prompt, BS)
    a, b = (SimpleNamespace(replica_id=ReplicaID(n), max_ongoing_requests=100, routing_stats={}) for n in "ab")
    a.routing_stats["cached_blocks"] = summarize(hashes[:3])
    b.routing_stats["cached_blocks"] = summarize(hashes[:1])

    def route(method: str, args: list, queues: dict[str, int]) -> tuple[list[list[str]], dict]:
        async def probe(candidates, _):
            return [(r, queues[r.replica_id.unique_id]) for r in candidates]
        router._probe_queue_lens = probe
        request = SimpleNamespace(metadata=SimpleNamespace(call_method=method), args=args, kwargs={},
                                  routing_context=SimpleNamespace(should_backoff=False))
        chosen = asyncio.run(router.choose_replicas([a, b], request))
        return [[r.replica_id.unique_id for r in group] for group in chosen], request.kwargs

    generate = [prompt, SamplingParams(), "rid", True, None]
    assert route(ROUTED_METHOD, generate, {"a": 0, "b": 0}) == ([["a"], ["b"]], {})  # the holder is free
    groups, kwargs = route(ROUTED_METHOD, generate, {"a": 1, "b": 0})
    assert groups[0] == ["b"] and kwargs == {"kv_source": KVSource("a", 3)}
    router.transfer = False
    assert route(ROUTED_METHOD, generate, {"a": 1, "b": 0})[1] == {}

    export = ["a", prompt, None, None, 1, 2]
    assert route(EXPORT_METHOD, export, {"a": 5, "b": 0})[0] == [["a"]]  # however busy it is
    assert route(EXPORT_METHOD, ["gone"] + export[1:], {"a": 0, "b": 0})[0] == [[]]
    # a prefill replica's prefill goes where its prompt's blocks are cached, as a request does
    assert route("prefill_export", [prompt[:4 * BS], SamplingParams(), "rid", 1, None], {"a": 0, "b": 0})[0][0] == ["a"]

    # a holder too busy to answer the probe in time is not sent the request, and is named as the holder
    router.transfer = True
    groups, kwargs = route(ROUTED_METHOD, generate, {"a": None, "b": 0})
    assert groups[0] == ["b"] and kwargs == {"kv_source": KVSource("a", 3)}


def test_a_request_that_ends_before_the_router_hears_it_was_routed_is_not_counted_in_flight_for_good():
    """Serve may tell the router that a short request ended before it tells it where the request went (both wait
    their turn on the router's event loop): the replica's queue is then what its probe says, not one more for good,
    so a busy holder's queue still counts as too long beside it."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from pagedserve.serving.prefix_router import ROUTED_METHOD, PrefixAwareRouter

    class FinishedResult:  # a replica's result already done: Ray runs a done-callback at once, on a thread of its own
        def add_done_callback(self, callback) -> None:
            thread = threading.Thread(target=callback, args=(self,))
            thread.start()
            thread.join()

    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router.initialize_state(BS, imbalance_threshold=2, memory_s=30.0)
    prompt, short = list(range(4 * BS + 1)), list(range(100, 100 + 2 * BS))
    holder, other = (SimpleNamespace(replica_id=n, max_ongoing_requests=100, routing_stats={}) for n in "ab")
    holder.routing_stats["cached_blocks"] = summarize(prefix_hashes(prompt, BS))

    def request(tokens: list[int], request_id: str) -> SimpleNamespace:
        return SimpleNamespace(metadata=SimpleNamespace(call_method=ROUTED_METHOD, internal_request_id=request_id),
                               args=[tokens, SamplingParams(), request_id, True, None], kwargs={},
                               routing_context=SimpleNamespace(should_backoff=False))

    async def probe(candidates, _):
        return [(r, {"a": 3, "b": 0}[r.replica_id]) for r in candidates]

    async def route_after_a_short_request_on_b() -> str:
        router.on_request_completed("b", "short")
        router.on_request_routed(request(short, "short"), "b", FinishedResult())
        await asyncio.sleep(0)  # the result's callback takes its turn on the loop
        router._probe_queue_lens = probe
        return (await router.choose_replicas([holder, other], request(prompt, "next")))[0][0].replica_id

    assert asyncio.run(route_after_a_short_request_on_b()) == "b"
    assert router._in_flight == {"b": set()}


def test_prefill_split_settings_are_checked_by_name():
    from pagedserve.serving.prefill_split import PrefillSplit
    from pagedserve.serving.serve_app import build_app

    assert PrefillSplit.parse(None) is None
    split = PrefillSplit.parse({"num_replicas": 2, "timeout_s": 5, "max_num_batched_tokens": 4096})
    assert (split.num_replicas, split.timeout_s, split.engine) == (2, 5, {"max_num_batched_tokens": 4096})
    with pytest.raises(ValueError, match=r"prefill has settings \['block_size', 'model'\] that prefill replicas "
                                         "cannot set apart"):
        PrefillSplit.parse({"model": "other", "block_size": 32})
    with pytest.raises(ValueError, match="prefill.timeout_s=0 must be > 0"):
        PrefillSplit.parse({"timeout_s": 0})
    with pytest.raises(ValueError, match="prefill=2 must be a mapping"):
        PrefillSplit.parse(2)
    with pytest.raises(ValueError, match="prefill: num_replicas=0 must be an integer >= 1"):
        build_app({"prefill": {"num_replicas": 0}})
    with pytest.raises(ValueError, match="prefill: max_num_seqs=0 must be"):
        build_app({"prefill": {"max_num_seqs": 0}})
    with pytest.raises(ValueError, match=r"prefix_routing.transfer=True with prefill: decode replicas take"):
        build_app({"num_replicas": 2, "prefix_routing": {"transfer": True}, "prefill": {}})
