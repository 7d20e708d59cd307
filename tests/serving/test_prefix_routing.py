"""Two engine replicas behind the prefix-aware router, on the real local Ray cluster: a conversation's next
turn goes to the replica holding its prefix (from what the router sent there, and from what replicas
publish), a flood of one prefix still spreads once one replica's queue is long, a request sent past the busy
holder of its prefix fetches the prefix's K/V from it, and killing a replica under load loses no request that
had not started."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import ray
from ray import serve

from pagedserve.client import AsyncClient, Client
from pagedserve.client.errors import Unavailable
from pagedserve.sampling_params import SamplingParams
from pagedserve.serving.model_server import replica_stats
from tests.serving.app import GRPC, ROUTED, answers_past_a_busy_holder

BS = 16  # deploy/config.yaml's block_size
PROMPT = 4 * BS + 3  # four full blocks and a partial one
VOCAB = range(100, 49_000)  # tiny_random shares SmolLM2's vocabulary


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(n)]


def _gained(before: dict[str, dict], key: str) -> dict[str, int]:
    return {name: stats[key] - before.get(name, {}).get(key, 0) for name, stats in replica_stats(ROUTED).items()}


def test_the_next_turn_goes_to_the_replica_holding_the_conversation(routed):
    rng = random.Random(1)
    with Client(GRPC, application=routed, timeout=120) as c:
        for _ in range(6):  # by chance (Serve's default router), all six would find their prefix 1 time in 64
            turn1 = _tokens(rng, PROMPT)
            answer = c.generate(turn1, max_tokens=8, temperature=0, ignore_eos=True).token_ids
            before = replica_stats(routed)
            c.generate(turn1 + answer + _tokens(rng, 5), max_tokens=2, ignore_eos=True)
            gained = _gained(before, "prefix_cache_hits")
            # every token of turn 1 and its answer but the answer's last (it has no K/V yet): 4 full blocks, and
            # the partial fifth one's tokens as the tail the first request left
            assert sorted(gained.values()) == [0, len(turn1) + len(answer) - 1], gained


def test_a_new_caller_routes_by_what_the_replicas_publish(routed):
    """A handle made now (its router has sent nothing anywhere) finds each conversation's replica from the
    cached blocks the replicas publish every second (by chance: 1 time in 256)."""
    rng = random.Random(2)
    with Client(GRPC, application=routed, timeout=120) as c:
        turns = [_tokens(rng, PROMPT) for _ in range(8)]
        for turn in turns:
            c.generate(turn, max_tokens=1)
    time.sleep(3)  # a stats period or two, and Serve's broadcast of them
    handle = serve.get_deployment_handle("ModelServer", routed)
    for turn in turns:
        before = replica_stats(routed)
        prompt = turn + _tokens(rng, 3)
        deltas = list(handle.options(stream=True).generate_deltas.remote(prompt, SamplingParams(max_tokens=1)))
        assert deltas[-1].finish_reason == "length"
        assert sorted(_gained(before, "prefix_cache_hits").values()) == [0, PROMPT]  # 4 blocks and a tail


def test_a_flood_of_one_prefix_spreads_once_one_queue_is_long(routed):
    rng = random.Random(3)
    prefix = _tokens(rng, 4 * BS)
    with Client(GRPC, application=routed, timeout=120) as c:
        c.generate(prefix + _tokens(rng, 1), max_tokens=1)  # one replica holds the prefix now
        before = replica_stats(routed)
        prompts = [prefix + _tokens(rng, 3) for _ in range(16)]
        with ThreadPoolExecutor(16) as pool:
            outs = list(pool.map(lambda p: c.generate(p, max_tokens=24, ignore_eos=True), prompts))
    assert all(len(o.token_ids) == 24 for o in outs)
    per_replica = {name: q // len(prompts[0]) for name, q in _gained(before, "prefix_cache_queries").items()}
    assert sum(per_replica.values()) == 16
    # without the threshold all sixteen would queue on the replica holding the prefix (4 running at a time)
    assert min(per_replica.values()) >= 3, per_replica


def test_a_request_sent_past_the_busy_holder_of_its_prefix_fetches_the_prefix_from_it(routed):
    """Three long streams of one prefix fill the queue of the replica holding it past the threshold, so a request
    with that prefix goes to the other replica, which fetches the prefix's 8 blocks from the holder: the tokens
    and logprobs the holder gave for the same prompt computed whole, and no block or page left on either side."""
    rng = random.Random(5)
    prefix = _tokens(rng, 8 * BS)
    prompt = prefix + _tokens(rng, 5)
    greedy = dict(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)

    async def run() -> tuple:
        async with AsyncClient(GRPC, application=routed, timeout=120) as c:
            return await answers_past_a_busy_holder(c, prompt, [prefix + _tokens(rng, 3) for _ in range(3)], 300,
                                                    **greedy)

    before = replica_stats(routed)
    whole, fetched = asyncio.run(run())
    assert fetched.token_ids == whole.token_ids
    assert [lp.logprob for lp in fetched.logprobs] == [lp.logprob for lp in whole.logprobs]
    imports, exports = _gained(before, "kv_transfer_imports"), _gained(before, "kv_transfer_exports")
    hits = _gained(before, "kv_transfer_hits")
    assert sorted(imports.values()) == [0, 1] and sorted(exports.values()) == [0, 1], (imports, exports)
    receiver = max(imports, key=imports.get)
    assert hits[receiver] == 8 * BS and exports[receiver] == 0
    assert all(gained == 0 for gained in _gained(before, "kv_transfer_failures").values())
    deadline = time.monotonic() + 30
    while any(s["num_free_blocks"] != s["num_total_blocks"] for s in replica_stats(routed).values()):
        assert time.monotonic() < deadline  # the cancelled streams' blocks come back
        time.sleep(0.2)


def test_killing_a_replica_under_load(routed):
    """Requests that had not started when their replica died run on the other; streams that had started end
    UNAVAILABLE; nothing hangs; the survivor ends holding no blocks. The client does not retry: what is
    checked is the server's doing."""
    rng = random.Random(4)
    received: list[int] = [0] * 24
    outcome: list[str] = [""] * 24

    async def one(c: AsyncClient, i: int) -> None:
        try:
            async for chunk in c.stream(_tokens(rng, 20), max_tokens=48, ignore_eos=True):
                received[i] += len(chunk.token_ids)
            outcome[i] = "ok" if received[i] == 48 else f"short: {received[i]}"
        except Unavailable:
            outcome[i] = "unavailable"

    names = sorted(replica_stats(ROUTED))
    # Its process, killed as a crash kills it: at once (ray.kill returns before the actor is gone, and the
    # replica goes on serving meanwhile, starting requests the test counts as not started).
    pid = ray.get(ray.get_actor(names[0], namespace="serve").__ray_call__.remote(lambda _: os.getpid()))

    async def load() -> list[int]:
        async with AsyncClient(GRPC, application=ROUTED, timeout=120, max_retries=0) as c:
            tasks = [asyncio.create_task(one(c, i)) for i in range(24)]
            while sum(1 for r in received if r) < 4:  # both replicas are decoding (4 at a time), 16 wait
                await asyncio.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            waiting_at_kill = [i for i, r in enumerate(received) if r == 0]
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)  # nothing hangs
            return waiting_at_kill

    waiting_at_kill = asyncio.run(load())
    survivor = names[1]
    assert set(outcome) <= {"ok", "unavailable"}, outcome
    assert "unavailable" in outcome  # the killed replica had streams under way
    # whatever ended UNAVAILABLE had started (a request that fails before its first token is run again)
    assert all(received[i] > 0 for i, o in enumerate(outcome) if o == "unavailable"), (received, outcome)
    # Only the requests the killed replica was running (max_num_seqs, 4, at most) may end UNAVAILABLE: every one
    # not started there ran on the survivor. (Some of the 4 may count as waiting here: their first token was on
    # its way to the client when the replica died.)
    unavailable = [i for i, o in enumerate(outcome) if o == "unavailable"]
    assert len(waiting_at_kill) >= 8 and len(unavailable) <= 4, (waiting_at_kill, received, outcome)
    deadline = time.monotonic() + 30
    while True:
        stats = replica_stats(ROUTED, [survivor])[survivor]  # (Serve is starting a replacement meanwhile)
        if stats["num_running"] == stats["num_waiting"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
