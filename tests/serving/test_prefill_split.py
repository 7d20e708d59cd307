"""Disaggregated prefill on the real local Ray cluster: one prefill replica (`PrefillServer`) computes the prompts
that one decode replica (`ModelServer`) decodes, their blocks moved between them over Ray. The tokens are those one
replica computing everything gives; a prefill replica that stalls, dies or whose request is aborted costs the request
nothing but time, and at the end neither side holds a block or a page."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from ray import serve

from pagedserve.client import AsyncClient, Client
from pagedserve.sampling_params import SamplingParams
from pagedserve.serving.model_server import replica_actor_names
from pagedserve.serving.serve_app import PREFILL_DEPLOYMENT
from tests.serving.app import BLOCK_BYTES, GREEDY, GRPC, MAX_MODEL_LEN

SPLIT = "split"
BS = 16  # deploy/config.yaml's block_size
TIMEOUT_S = 6  # the longest the decode replica waits for a prefill
VOCAB = range(100, 49_000)  # tiny_random shares SmolLM2's vocabulary


@pytest.fixture(scope="module")
def split(app, tiny_random):
    from pagedserve.serving.serve_app import build_app

    serve.run(build_app({"model": tiny_random, "max_model_len": MAX_MODEL_LEN, "kv_cache_memory": 96 * BLOCK_BYTES,
                         "prefill": {"num_replicas": 1, "timeout_s": TIMEOUT_S, "max_num_seqs": 2}}),
              name=SPLIT, route_prefix=f"/{SPLIT}")
    yield SPLIT
    serve.delete(SPLIT)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(n)]


def _stats(deployment: str) -> dict:
    return serve.get_deployment_handle(deployment, SPLIT).stats.remote().result()


def _gained(before: dict, deployment: str, key: str) -> int:
    return _stats(deployment)[key] - before[key]


def _wait_until_clear(deployment: str, timeout: float = 30) -> None:
    """Until the replica runs nothing, holds every block free and no staged pages."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(deployment)
        if (stats["num_running"] == stats["num_waiting"] == stats["kv_transfer_staged"] == 0
                and stats["num_free_blocks"] == stats["num_total_blocks"]):
            return
        assert time.monotonic() < deadline, (deployment, stats)
        time.sleep(0.1)


@contextlib.contextmanager
def _prefill_stalled():
    """The prefill replica's worker stopped, as a stalled node stops: its replica takes requests and finishes none."""
    pids = serve.get_deployment_handle(PREFILL_DEPLOYMENT, SPLIT).worker_pids.remote().result()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _wait_for_prefill_request(timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (lambda s: s["num_running"] + s["num_waiting"])(_stats(PREFILL_DEPLOYMENT)) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_prompts_prefilled_elsewhere_decode_to_the_tokens_one_replica_gives(split, offline):
    rng = random.Random(5)
    prompts = [_tokens(rng, n) for n in (5, 16, 17, 40, 100)]  # 0, 0, 1, 2 and 6 full blocks before the last token
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=12)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, SamplingParams(**GREEDY))]
    expected_seeded = offline.generate(prompts[-1:], seeded)[0].outputs[0].token_ids
    decode, prefill = _stats("ModelServer"), _stats(PREFILL_DEPLOYMENT)
    with Client(GRPC, application=split, timeout=120) as c:
        assert [c.generate(p, **GREEDY).token_ids for p in prompts] == expected
        assert _gained(decode, "ModelServer", "kv_transfer_imports") == 3
        assert _gained(decode, "ModelServer", "kv_transfer_hits") == (1 + 2 + 6) * BS  # every full block imported
        assert _gained(prefill, PREFILL_DEPLOYMENT, "kv_transfer_exports") == 3
        # the same prompt again: its blocks are the decode replica's own now, and no prefill is asked for
        decode = _stats("ModelServer")
        assert c.generate(prompts[-1], temperature=0.8, seed=3, max_tokens=12).token_ids == expected_seeded
        assert _gained(decode, "ModelServer", "kv_transfer_imports") == 0
        # the conversation's next turn: only the blocks the decode replica lacks are prefilled elsewhere
        turn = prompts[-1] + expected[-1] + _tokens(rng, 20)  # 144 tokens: 8 full blocks, 7 held (123 computed)
        decode = _stats("ModelServer")
        assert c.generate(turn, **GREEDY).token_ids == offline.generate([turn], SamplingParams(**GREEDY))[0].outputs[
            0].token_ids
        assert _gained(decode, "ModelServer", "kv_transfer_hits") == BS
    _wait_until_clear("ModelServer")
    _wait_until_clear(PREFILL_DEPLOYMENT)


def test_a_stalled_prefill_replica_is_given_up_on_and_the_request_computed_where_it_decodes(split, offline):
    prompt = _tokens(random.Random(6), 70)
    expected = offline.generate([prompt], SamplingParams(**GREEDY))[0].outputs[0].token_ids
    decode = _stats("ModelServer")
    with Client(GRPC, application=split, timeout=120) as c, _prefill_stalled():
        start = time.monotonic()
        assert c.generate(prompt, **GREEDY).token_ids == expected
        assert time.monotonic() - start >= TIMEOUT_S
    assert _gained(decode, "ModelServer", "kv_transfer_failures") == 1
    assert _gained(decode, "ModelServer", "kv_transfer_imports") == 0
    _wait_until_clear("ModelServer")
    _wait_until_clear(PREFILL_DEPLOYMENT)  # the prefill given up on was cancelled there


def test_a_request_aborted_while_it_prefills_elsewhere_is_dropped_on_both_sides(split):
    prompt = _tokens(random.Random(7), 70)

    async def abort_while_prefilling() -> None:
        async with AsyncClient(GRPC, application=split, timeout=120) as c:
            async def read() -> None:
                async for _ in c.stream(prompt, **GREEDY):
                    pass

            task = asyncio.create_task(read())
            await asyncio.to_thread(_wait_for_prefill_request)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    with _prefill_stalled():
        asyncio.run(abort_while_prefilling())
        _wait_until_clear("ModelServer")
        _wait_until_clear(PREFILL_DEPLOYMENT)  # dropped there while its worker still stalls
    _wait_until_clear(PREFILL_DEPLOYMENT)


def test_a_prefill_replica_that_dies_mid_prefill_costs_the_request_nothing_but_time(split, offline):
    rng = random.Random(8)
    prompt, after = _tokens(rng, 70), _tokens(rng, 50)
    expected = [o.outputs[0].token_ids for o in offline.generate([prompt, after], SamplingParams(**GREEDY))]
    replica = _prefill_replicas()[0]
    pid = ray.get(ray.get_actor(replica, namespace="serve").__ray_call__.remote(lambda _: os.getpid()))
    decode = _stats("ModelServer")
    with Client(GRPC, application=split, timeout=120) as c, ThreadPoolExecutor(1) as pool:
        with _prefill_stalled():
            answer = pool.submit(c.generate, prompt, **GREEDY)
            _wait_for_prefill_request()
            start = time.monotonic()
            os.kill(pid, signal.SIGKILL)  # as a crash kills it; its workers go with it
            assert answer.result(timeout=60).token_ids == expected[0]
            assert time.monotonic() - start < TIMEOUT_S  # given up on when it died, not when the wait ran out
        assert _gained(decode, "ModelServer", "kv_transfer_failures") == 1
        _wait_until_clear("ModelServer")
        deadline = time.monotonic() + 120
        while not (_prefill_replicas() and replica not in _prefill_replicas() and serve.status().applications[
                SPLIT].deployments[PREFILL_DEPLOYMENT].status == "HEALTHY"):
            assert time.monotonic() < deadline  # Serve replaces it
            time.sleep(0.5)
        decode = _stats("ModelServer")
        assert c.generate(after, **GREEDY).token_ids == expected[1]
        assert _gained(decode, "ModelServer", "kv_transfer_imports") == 1  # prefilled by its successor
    _wait_until_clear("ModelServer")
    _wait_until_clear(PREFILL_DEPLOYMENT)


def _prefill_replicas() -> list[str]:
    """The names of the prefill deployment's replica actors."""
    return replica_actor_names(SPLIT, PREFILL_DEPLOYMENT)
