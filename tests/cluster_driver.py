"""The driver of the multi-node tests (`test_multinode.py`), run on the head node of a cluster that
`scripts/netns-cluster.sh` started (RAY_ADDRESS set): it deploys two model replicas, which the nodes' CPUs place one
per node, and checks through gRPC that the prefix router and KV transfers work across the nodes. Exits non-zero
(an AssertionError and its values) where anything differs.

    python -m tests.cluster_driver <model>
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

import ray
import yaml
from ray import serve

from pagedserve.client import AsyncClient, Client
from pagedserve.serving.model_server import replica_stats
from pagedserve.serving.serve_app import build_app
from tests.serving.app import BLOCK_BYTES, CONFIG, answers_past_a_busy_holder

APP = "spread"
GRPC = "127.0.0.1:9000"
BS = 16  # deploy/config.yaml's block_size
VOCAB = range(100, 49_000)  # tiny_random shares SmolLM2's vocabulary


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(n)]


def _gained(before: dict[str, dict], key: str) -> dict[str, int]:
    return {name: stats[key] - before[name][key] for name, stats in replica_stats(APP).items()}


def replica_nodes() -> dict[str, str]:
    """Each replica actor's node's address."""
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    nodes = {}
    for name in replica_stats(APP):
        actor = ray.get_actor(name, namespace="serve")
        nodes[name] = addresses[ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))]
    return nodes


def routes_by_prefix_across_nodes(rng: random.Random) -> None:
    """A conversation's next turn goes to the replica, on whichever node, that holds the conversation."""
    with Client(GRPC, application=APP, timeout=120) as c:
        for _ in range(4):
            turn1 = _tokens(rng, 4 * BS + 3)
            answer = c.generate(turn1, max_tokens=8, temperature=0, ignore_eos=True).token_ids
            before = replica_stats(APP)
            c.generate(turn1 + answer + _tokens(rng, 5), max_tokens=2, ignore_eos=True)
            gained = _gained(before, "prefix_cache_hits")
            assert sorted(gained.values()) == [0, len(turn1) + len(answer) - 1], gained


def fetches_a_prefix_from_the_other_node(rng: random.Random) -> None:
    """The holder of a prefix made busy, a request with that prefix goes to the replica on the other node, which
    fetches the prefix's blocks from it over the network: the tokens and logprobs the holder gave."""
    prefix = _tokens(rng, 8 * BS)
    prompt = prefix + _tokens(rng, 5)
    greedy = dict(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)

    async def run() -> tuple:
        async with AsyncClient(GRPC, application=APP, timeout=120) as c:
            return await answers_past_a_busy_holder(c, prompt, [prefix + _tokens(rng, 3) for _ in range(2)], 300,
                                                    **greedy)

    before = replica_stats(APP)
    whole, fetched = asyncio.run(run())
    assert fetched.token_ids == whole.token_ids
    assert [lp.logprob for lp in fetched.logprobs] == [lp.logprob for lp in whole.logprobs]
    imports = _gained(before, "kv_transfer_imports")
    assert sorted(imports.values()) == [0, 1], imports
    assert sorted(_gained(before, "kv_transfer_hits").values()) == [0, 8 * BS]


def nothing_held(timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = replica_stats(APP)
        if all(s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]
               for s in stats.values()):
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


def main(model: str) -> None:
    config = yaml.safe_load(CONFIG.read_text())
    ray.init(runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}}, logging_level="ERROR")
    serve.start(grpc_options=config["grpc_options"])
    try:
        # Each replica takes 2 CPUs (its engine and its worker) and each node has 2: one replica per node.
        serve.run(build_app({"model": model, "max_model_len": 512, "kv_cache_memory": 160 * BLOCK_BYTES,
                             "num_replicas": 2, "worker_cpus": 1, "max_num_seqs": 2,
                             "prefix_routing": {"imbalance_threshold": 0, "transfer": "always"}}),
                  name=APP, route_prefix=f"/{APP}")
        nodes = replica_nodes()
        assert sorted(nodes.values()) == ["10.88.0.1", "10.88.0.2"], nodes
        rng = random.Random(9)
        routes_by_prefix_across_nodes(rng)
        fetches_a_prefix_from_the_other_node(rng)
        nothing_held()
        print("replicas on", sorted(nodes.values()), "routed by prefix and moved KV across them", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
