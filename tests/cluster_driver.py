"""The driver of the multi-node tests (`test_multinode.py`), run on the head node of a cluster of two nodes that
`scripts/netns-cluster.sh` started (RAY_ADDRESS set). `deploy` deploys the application as a user would (`serve run`
of a config: two model replicas, which the nodes' CPUs place one per node, and the Ingress on the head); every other
scenario checks one thing through gRPC: the prefix router and KV transfers across the nodes, or the cluster under a
fault (a node lost, a link down, a worker actor killed, the Serve controller restarted, a forward pass that raises)
while requests stream. Exits non-zero (an AssertionError and its values) where anything differs.

    python -m tests.cluster_driver <cluster> <model> <scenario>
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import ray
import yaml
from ray import serve

from pagedserve.client import AsyncClient, Client, DeadlineExceeded, PagedServeError, Unavailable
from pagedserve.serving.model_server import replica_actor_names, replica_stats
from tests.serving.app import BLOCK_BYTES, CONFIG, answers_past_a_busy_holder

APP = "spread"
GRPC = "127.0.0.1:9000"
BS = 16  # deploy/config.yaml's block_size
VOCAB = range(100, 49_000)  # tiny_random shares SmolLM2's vocabulary
HEAD, OTHER = "10.88.0.1", "10.88.0.2"
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "netns-cluster.sh"
DASHBOARD = "http://127.0.0.1:8265"  # the head's Ray dashboard, inside its namespace
STREAM_TIMEOUT_S = 30.0  # each stream's deadline under load
SHORT_TIMEOUT_S = 1.5  # the deadline of requests meant to pass theirs
LATE_S = 2.0  # how far past its deadline a call may end (the deadline's own grace: gRPC's, the proxy's)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(n)]


def _gained(before: dict[str, dict], key: str) -> dict[str, int]:
    return {name: stats[key] - before[name][key] for name, stats in replica_stats(APP).items()}


# ---- the application and where its replicas run ---------------------------------------------------------------

def deploy(model: str) -> None:
    """`serve run` of deploy/config.yaml as a user would write it for this cluster: two replicas that fit one per
    node, and Serve's per-deployment settings placing the Ingress on the head node, which no fault here takes."""
    config = yaml.safe_load(CONFIG.read_text())
    app = config["applications"][0]
    app.update(name=APP, route_prefix=f"/{APP}", runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    # Each replica takes 2 CPUs (its engine and its worker) and each node has 2: one replica per node.
    app["args"] = {"model": model, "max_model_len": 512, "kv_cache_memory": 160 * BLOCK_BYTES, "num_replicas": 2,
                   "worker_cpus": 1, "max_num_seqs": 2, "max_waiting_requests": 64,
                   "prefix_routing": {"imbalance_threshold": 0, "transfer": "always"}}
    app["deployments"] = [{"name": "Ingress",
                           "ray_actor_options": {"num_cpus": 0, "resources": {"node:__internal_head__": 0.01}}}]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(config, f)
        f.flush()
        subprocess.run([str(Path(sys.executable).parent / "serve"), "run", "--non-blocking", f.name], check=True,
                       timeout=120)
    replicas_on_both_nodes(timeout=180)


def replica_nodes() -> dict[str, str]:
    """Each running replica actor's node's address."""
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    nodes = {}
    for name in replica_actor_names(APP):
        actor = ray.get_actor(name, namespace="serve")
        node = ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()), timeout=10)
        nodes[name] = addresses.get(node, node)
    return nodes


def replicas_on_both_nodes(timeout: float) -> dict[str, str]:
    """Once the application runs two replicas, one on each node (or AssertionError after `timeout`): the replica
    actor names by node."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status = serve.status().applications.get(APP)
            if status is not None and status.status == "RUNNING":
                nodes = replica_nodes()
                by_node = {ip: name for name, ip in nodes.items()}
                if sorted(by_node) == [HEAD, OTHER] and len(nodes) == 2:
                    return by_node
        except Exception:  # a replica dying or the controller restarting: ask again
            pass
        assert time.monotonic() < deadline, f"no replica on each node after {timeout:.0f}s: {serve.status()}"
        time.sleep(1)


def on_model_server(replica: str, fn):
    """`fn(model_server)` run in the replica actor's process, on its `ModelServer`; what it returns."""
    actor = ray.get_actor(replica, namespace="serve")
    return ray.get(actor.__ray_call__.remote(
        lambda replica_actor: fn(replica_actor._replica_impl._user_callable_wrapper.user_callable)), timeout=30)


def nothing_held(replicas: list[str], timeout: float = 30) -> None:
    """Once `replicas` run nothing and hold no block (or AssertionError after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = replica_stats(APP, replicas)
        if all(s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]
               for s in stats.values()):
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


def streaming(replica: str, min_tokens: int, min_left: int) -> int:
    """Requests `replica` is running that have produced `min_tokens` tokens or more and have `min_left` more to go."""
    def count(server) -> int:
        return sum(1 for seq in list(server.engine.llm_engine.scheduler.running) if seq.num_output_tokens >= min_tokens
                   and seq.request.max_tokens - seq.num_output_tokens >= min_left)
    return on_model_server(replica, count)


def when_busy(replica: str, fault, min_tokens: int = 8, min_left: int = 24, timeout: float = 60):
    """`fault` made to strike while `replica` is computing requests whose first tokens have reached their clients:
    running `min_tokens` tokens or more (their first ones produced steps ago, and sent as they came), with `min_left`
    to go (so that they are still running when the fault lands, however slowly the steps come). Running requests are
    not enough: under load they may all be in their prefill, and a failure runs those again instead of failing them;
    nor is a first token, which may not have left the replica yet."""
    def strike() -> None:
        deadline = time.monotonic() + timeout
        while not (busy := streaming(replica, min_tokens, min_left)):
            assert time.monotonic() < deadline, f"{replica} streamed nothing for {timeout} s under load"
            time.sleep(0.05)
        print(f"the fault strikes {replica} running {busy} requests with {min_tokens} tokens or more and {min_left} "
              "to go", flush=True)
        return fault()

    return strike


def cluster(*args: str) -> None:
    subprocess.run([str(SCRIPT), *args], check=True, timeout=240)


# ---- requests under load --------------------------------------------------------------------------------------

@dataclass
class Outcome:
    kind: str  # "ok", or the error's class name
    tokens: int  # the tokens the client received
    wanted: int  # max_tokens
    seconds: float
    timeout: float
    error: str = ""


class Load:
    """Streams, `concurrency` at a time, until stopped: prompts of random tokens (a third of them continuing an
    earlier one, so that the router has prefixes to follow), and beside them one request at a time that passes its
    short deadline. Each call's outcome kept."""

    def __init__(self, client: AsyncClient, rng: random.Random, concurrency: int = 6) -> None:
        self.client, self.rng, self.concurrency = client, rng, concurrency
        self.outcomes: list[Outcome] = []
        self.stopping = asyncio.Event()
        self.prompts: list[list[int]] = []

    async def _call(self, prompt: list[int], max_tokens: int, timeout: float) -> None:
        start, received = time.monotonic(), 0
        kind, error = "ok", ""
        try:
            async for chunk in self.client.stream(prompt, max_tokens=max_tokens, ignore_eos=True, timeout=timeout):
                received += len(chunk.token_ids)
        except PagedServeError as e:
            kind, error = type(e).__name__, str(e)
        self.outcomes.append(Outcome(kind, received, max_tokens, time.monotonic() - start, timeout, error))

    def _prompt(self) -> list[int]:
        rng = self.rng
        if self.prompts and rng.random() < 1 / 3:
            return rng.choice(self.prompts) + _tokens(rng, rng.randint(1, 8))
        prompt = _tokens(rng, rng.randint(8, 3 * BS))
        self.prompts.append(prompt)
        return prompt

    async def _streams(self) -> None:
        while not self.stopping.is_set():
            await self._call(self._prompt(), self.rng.randint(16, 96), STREAM_TIMEOUT_S)

    async def _late_ones(self) -> None:
        while not self.stopping.is_set():
            await self._call(self._prompt(), 400, SHORT_TIMEOUT_S)

    async def run(self, fault, seconds_after: float) -> None:
        """The load; `fault()` (in a thread) once it has answered a few streams, and the load for `seconds_after`
        more; then every call in flight awaited (each ends by its deadline)."""
        tasks = [asyncio.create_task(self._streams()) for _ in range(self.concurrency)]
        tasks.append(asyncio.create_task(self._late_ones()))
        while sum(o.kind == "ok" for o in self.outcomes) < 2 * self.concurrency:
            await asyncio.sleep(0.1)
        if fault is not None:
            await asyncio.to_thread(fault)
        await asyncio.sleep(seconds_after)
        self.stopping.set()
        await asyncio.gather(*tasks)

    def check(self, unavailable_allowed: bool) -> Counter:
        """Each call answered whole, or ended by its deadline (the short ones), or, where a fault took the replica
        or the workers running it, ended UNAVAILABLE after it had started (with what it produced); none past its
        deadline. The count of each outcome."""
        for o in self.outcomes:
            assert o.seconds <= o.timeout + LATE_S, o
            if o.kind == "ok":
                assert o.tokens == o.wanted, o
            elif o.kind == DeadlineExceeded.__name__:
                assert o.timeout == SHORT_TIMEOUT_S, o
            else:
                assert o.kind == Unavailable.__name__ and unavailable_allowed, o
                assert o.tokens > 0, f"a request that had not started failed instead of running elsewhere: {o}"
        return Counter(o.kind for o in self.outcomes)


def under_load(fault=None, seconds_after: float = 8.0, unavailable_allowed: bool = False, seed: int = 0) -> Load:
    async def run() -> Load:
        async with AsyncClient(GRPC, application=APP, timeout=STREAM_TIMEOUT_S, max_retries=0) as c:
            load = Load(c, random.Random(seed))
            await load.run(fault, seconds_after)
            return load

    load = asyncio.run(run())
    counts = load.check(unavailable_allowed)
    print("outcomes:", dict(counts), "longest call past its deadline:",
          f"{max(o.seconds - o.timeout for o in load.outcomes):.2f}s", flush=True)
    assert counts["ok"] > 2 * load.concurrency, counts
    return load


def serves_on(timeout: float = 180) -> dict[str, str]:
    """After a fault: a replica on each node again, every request of a new load answered, nothing held."""
    by_node = replicas_on_both_nodes(timeout)
    under_load(seconds_after=2, seed=1)
    nothing_held(list(by_node.values()))
    return by_node


# ---- the scenarios --------------------------------------------------------------------------------------------

def routes_and_moves_kv(_: str) -> None:
    rng = random.Random(9)
    routes_by_prefix_across_nodes(rng)
    fetches_a_prefix_from_the_other_node(rng)
    nothing_held(list(replica_nodes()))
    print("replicas on", sorted(replica_nodes().values()), "routed by prefix and moved KV across them", flush=True)


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


def dashboard(_: str) -> None:
    """The Ray dashboard in headless Chromium, logged in with the cluster's token as its login form would: its
    Serve page lists the application, running, and its deployments, healthy; the ModelServer deployment's page
    lists each replica, running. Screenshots of both into SCREENSHOTS (a directory), where it is set."""
    from tests.browser import page_text

    token = subprocess.run([str(Path(sys.executable).parent / "ray"), "get-auth-token"], capture_output=True,
                           text=True, check=True).stdout.strip()
    cookie = ("ray-authentication-token", token)
    shots = Path(os.environ["SCREENSHOTS"]) if os.environ.get("SCREENSHOTS") else None
    expected = [rf"{APP}\s+RUNNING", r"ModelServer\s+HEALTHY\s+-\s+2\b", r"Ingress\s+HEALTHY\s+-\s+1\b"]
    text = page_text(f"{DASHBOARD}/#/serve", cookie, expected, shots and shots / "ray-dashboard-serve.png")
    assert all(re.search(e, text) for e in expected), text
    replicas = [name.rsplit("#", 1)[1] for name in replica_nodes()]
    expected = [rf"{replica}\s+RUNNING" for replica in replicas]
    text = page_text(f"{DASHBOARD}/#/serve/applications/{APP}/ModelServer", cookie, expected,
                     shots and shots / "ray-dashboard-replicas.png")
    assert all(re.search(e, text) for e in expected), text
    print("the dashboard lists", APP, "and its replicas", replicas, flush=True)


def prometheus(_: str) -> None:
    """A Prometheus on the head node with the configuration Ray's dashboard writes for the cluster (every node's
    metrics endpoint, found through Ray's service-discovery file): it scrapes both nodes, and each replica's series
    come from the node it runs on."""
    from tests.serving.test_monitoring import api, prometheus_binary

    config = Path(os.environ["RAY_TMPDIR"]) / "ray" / "session_latest" / "metrics" / "prometheus" / "prometheus.yml"
    nodes = {name.rsplit("#", 1)[1]: ip for name, ip in replica_nodes().items()}
    with tempfile.TemporaryDirectory() as data, subprocess.Popen(
            [prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={data}",
             "--web.listen-address=127.0.0.1:9090"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        try:
            deadline = time.monotonic() + 90  # Ray's configuration scrapes every 10 s
            while True:
                try:
                    series = api("http://127.0.0.1:9090", "series",
                                 **{"match[]": f'ray_pagedserve_requests_running{{application="{APP}"}}'})
                    found = {s["replica"]: s["instance"].split(":")[0] for s in series}
                except OSError:  # not listening yet
                    found = {}
                if found == nodes or time.monotonic() > deadline:
                    break
                time.sleep(2)
            assert found == nodes, (found, nodes)
        finally:
            proc.terminate()
    print("Prometheus scraped", sorted(set(nodes.values())), flush=True)


def controller_restarted(_: str) -> None:
    """Serve's controller killed and restarted by Ray mid-load: the data path does not need it, so every request
    is answered; it comes back with the application as it was."""
    before = replicas_on_both_nodes(30)

    def restart() -> None:
        ray.kill(ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve"), no_restart=False)

    under_load(restart)
    assert serves_on() == before


def link_down(cluster_name: str) -> None:
    """The other node's link down for 5 seconds and back mid-load: requests on it wait and then finish, none is
    lost and none passes its deadline."""
    before = replicas_on_both_nodes(30)

    def cut() -> None:
        cluster("link", cluster_name, "1", "down")
        time.sleep(5)
        cluster("link", cluster_name, "1", "up")

    load = under_load(cut)
    assert max(o.seconds for o in load.outcomes) > 5, "no request waited out the cut"
    assert serves_on() == before


def _workers(replica: str) -> list:
    return on_model_server(replica, lambda server: list(server.engine.llm_engine.executor.workers))


def worker_killed(_: str) -> None:
    """The worker actor of the other node's replica killed mid-load: the streams it was computing end UNAVAILABLE
    with what they produced, the requests it had not started run (after the engine replaced its workers, or on
    the other replica), and the engine serves on."""
    replica = replicas_on_both_nodes(30)[OTHER]
    (worker,) = _workers(replica)
    failures = replica_stats(APP, [replica])[replica]["num_worker_failures"]
    load = under_load(when_busy(replica, lambda: ray.kill(worker, no_restart=True)), unavailable_allowed=True)
    assert any(o.kind == Unavailable.__name__ for o in load.outcomes), "the killed worker was computing nothing"
    after = serves_on()
    assert replica_stats(APP, [after[OTHER]])[after[OTHER]]["num_worker_failures"] >= failures + (
        after[OTHER] == replica)


def forward_raises(_: str) -> None:
    """A forward pass of the other node's replica raises (the model's logits, once) mid-load: the requests that
    step computed end UNAVAILABLE with what they produced, and that same replica serves on."""
    replica = replicas_on_both_nodes(30)[OTHER]
    (worker,) = _workers(replica)

    def inject(actor) -> None:
        model = actor.worker.model

        def raises(*args, **kwargs):
            del model.compute_logits  # once: the next step computes as ever
            raise RuntimeError("a fault injected into the forward pass")

        model.compute_logits = raises

    failures = replica_stats(APP, [replica])[replica]["num_worker_failures"]
    load = under_load(when_busy(replica, lambda: ray.get(worker.__ray_call__.remote(inject))),
                      unavailable_allowed=True)
    assert any(o.kind == Unavailable.__name__ for o in load.outcomes), "the failed step was computing nothing"
    assert serves_on()[OTHER] == replica  # the replica that raised, not a replacement
    assert replica_stats(APP, [replica])[replica]["num_worker_failures"] == failures + 1


def node_killed(cluster_name: str) -> None:
    """The other node lost mid-load (its raylet and every process on it): the streams it was running end
    UNAVAILABLE with what they produced, every request that had not started there runs on the head's replica,
    which holds nothing afterwards; when the node comes back, Serve places a new replica on it."""
    replicas = replicas_on_both_nodes(30)
    survivor = replicas[HEAD]
    load = under_load(when_busy(replicas[OTHER], lambda: cluster("kill", cluster_name, "1")),
                      unavailable_allowed=True, seconds_after=15)
    assert any(o.kind == Unavailable.__name__ for o in load.outcomes), "the lost node was running nothing"
    nothing_held([survivor])
    cluster("start", cluster_name, "1")
    assert serves_on(timeout=240)[HEAD] == survivor


def shutdown(_: str) -> None:
    serve.shutdown()


SCENARIOS = {f.__name__: f for f in (routes_and_moves_kv, dashboard, prometheus, controller_restarted, link_down,
                                     worker_killed, forward_raises, node_killed, shutdown)}


def main(cluster_name: str, model: str, scenario: str) -> None:
    ray.init(runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}}, logging_level="ERROR")
    try:
        if scenario == "deploy":
            deploy(model)
        else:
            SCENARIOS[scenario](cluster_name)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
