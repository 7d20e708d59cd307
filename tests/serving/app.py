"""Where the served test application lives and how to read its engines' state."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "config.yaml"
GRPC = "127.0.0.1:9000"
HTTP = "http://127.0.0.1:8000"
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny_random: layers x (K, V) x block x kv heads x head dim x fp32
MAX_MODEL_LEN = 512
POOL_BLOCKS = 24  # 384 tokens: a request of 410 never fits; 50 concurrent streams must preempt
API_KEYS = ["key-one", "key-two"]  # of the "keyed" application
ROUTED = "routed"  # the application of two replicas behind the prefix-aware router (conftest.py's `routed_app`)
GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)
# The open application's speculative decoding: tiny_random's greedy output repeats itself, so proposals are kept
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


METRICS_PORT = free_port()


def engine_stats(app_name: str = "pagedserve") -> dict:
    from ray import serve

    return serve.get_deployment_handle("ModelServer", app_name).stats.remote().result()


def wait_idle(app_name: str = "pagedserve", timeout: float = 30) -> dict:
    """The engine's stats once it runs nothing and holds no blocks (or when `timeout` is up)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(app_name)
        if (stats["num_running"] == stats["num_waiting"] == 0
                and stats["num_free_blocks"] == stats["num_total_blocks"]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


async def answers_past_a_busy_holder(client, prompt: list[int], busy_prompts: list[list[int]], busy_tokens: int,
                                     **sampling) -> tuple:
    """`prompt`'s answer computed whole by the replica that then holds it, and its answer again while that replica
    streams `busy_prompts` (each sharing the prefix: the holder's), so that the router sends it elsewhere."""
    whole = await client.generate(prompt, **sampling)
    received = [0] * len(busy_prompts)

    async def stream(i: int) -> None:
        async for chunk in client.stream(busy_prompts[i], max_tokens=busy_tokens, ignore_eos=True):
            received[i] += len(chunk.token_ids)

    busy = [asyncio.create_task(stream(i)) for i in range(len(busy_prompts))]
    while not all(received):
        assert not any(task.done() for task in busy), [task.result() for task in busy if task.done()]
        await asyncio.sleep(0.02)
    fetched = await client.generate(prompt, **sampling)
    for task in busy:
        task.cancel()
    await asyncio.gather(*busy, return_exceptions=True)
    return whole, fetched
