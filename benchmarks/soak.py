"""A soak of the served application: many requests of every kind through both front ends, one of two replicas killed
half-way, and each process's memory sampled throughout.

  scripts/loopback-netns.sh .venv/bin/python benchmarks/soak.py                  # 10,000 requests
  scripts/loopback-netns.sh .venv/bin/python benchmarks/soak.py --requests 2000 --out /tmp/soak.json

Two model replicas (a 2-layer random-weight model with SmolLM2's vocabulary and tokenizer, so that requests are
many and short) behind the prefix router. Request i, `--concurrency` at a time, is one of: a gRPC stream, a gRPC
unary call, an HTTP completion, an HTTP chat streamed as server-sent events, a gRPC stream the client cancels after
its first chunk, a gRPC call with a deadline shorter than its answer, or one of the bad inputs of the test corpus
(`tests/serving/test_bad_input.py`: over HTTP and gRPC, each sent in turn). When half have been sent, one replica's
actor is killed; Serve starts another.

Every outcome must be clean: an answer; the client's own cancel; DEADLINE_EXCEEDED for a call that asked for it;
4xx / INVALID_ARGUMENT for bad input (never a 5xx); UNAVAILABLE / 503 only for a request that had started on the
killed replica. At the end every replica holds no KV block, and the RSS of each process (sampled every
`--sample-s` seconds) is fit against the requests answered, after the first fifth: its slope in MB per 1,000
requests is the trend reported. Exits non-zero where anything is not clean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import yaml
from environment import announce

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the bad-input corpus of the tests

from tests.serving.test_bad_input import GRPC_CASES, HTTP_CASES  # noqa: E402
from tests.tiny_models import tiny_smollm2_config  # noqa: E402

CONFIG = REPO / "deploy" / "config.yaml"
GRPC = "127.0.0.1:9000"
HTTP = "http://127.0.0.1:8000"
APP = "soak"
KINDS = ["grpc_stream"] * 30 + ["grpc_unary"] * 15 + ["http_completion"] * 15 + ["http_chat_stream"] * 10 + \
    ["cancel"] * 10 + ["deadline"] * 5 + ["bad_input"] * 15
VOCAB = range(100, 49_000)


def tiny_model(directory: Path) -> str:
    """`random:<config.json>`: a 2-layer Llama with SmolLM2's vocabulary and tokenizer (the embedded model's)."""
    from pagedserve.workers.loader import resolve_model

    return f"random:{tiny_smollm2_config(directory, resolve_model(None).weights_dir)}"


class Soak:
    def __init__(self, grpc_client, http) -> None:
        self.grpc, self.http = grpc_client, http
        self.outcomes: Counter = Counter()
        self.unclean: list[str] = []
        self.answered = 0
        self.killed_at: float | None = None
        self.bad_sent = 0
        self.model = ""  # the served model's name (GET /v1/models)

    def note(self, kind: str, outcome: str, clean: bool, detail: str = "") -> None:
        self.outcomes[f"{kind}: {outcome}"] += 1
        self.answered += 1
        if self.answered % 1000 == 0:
            print(f"{self.answered} answered, {len(self.unclean)} not clean", flush=True)
        if not clean:
            self.unclean.append(f"{kind}: {outcome} {detail}"[:400])

    def started_on_the_killed_replica(self, start: float) -> bool:
        """Whether a request was in flight when the replica was killed (it may have been on it)."""
        return self.killed_at is not None and start < self.killed_at + 1.0

    async def one(self, rng: random.Random) -> None:
        kind = KINDS[rng.randrange(len(KINDS))]
        prompt = [rng.choice(VOCAB) for _ in range(rng.randint(4, 60))]
        start = time.monotonic()
        try:
            await getattr(self, kind)(kind, prompt, rng, start)
        except Exception as e:  # anything the kinds below did not expect
            self.note(kind, type(e).__name__, False, str(e))

    async def grpc_stream(self, kind, prompt, rng, start) -> None:
        from pagedserve.client import PagedServeError, Unavailable

        wanted, got = rng.randint(4, 32), 0
        try:
            async for chunk in self.grpc.stream(prompt, max_tokens=wanted, ignore_eos=True):
                got += len(chunk.token_ids)
        except Unavailable as e:
            return self.note(kind, "UNAVAILABLE", got > 0 and self.started_on_the_killed_replica(start), str(e))
        except PagedServeError as e:
            return self.note(kind, type(e).__name__, False, str(e))
        self.note(kind, "ok", got == wanted, f"{got} of {wanted} tokens")

    async def grpc_unary(self, kind, prompt, rng, start) -> None:
        from pagedserve.client import PagedServeError, Unavailable

        wanted = rng.randint(4, 32)
        try:
            out = await self.grpc.generate(prompt, max_tokens=wanted, ignore_eos=True, temperature=0.8,
                                           seed=rng.randrange(2**31))
        except Unavailable as e:  # the server runs again elsewhere a request that had produced nothing
            return self.note(kind, "UNAVAILABLE", self.started_on_the_killed_replica(start), str(e))
        except PagedServeError as e:
            return self.note(kind, type(e).__name__, False, str(e))
        self.note(kind, "ok", len(out.token_ids) == wanted)

    async def http_completion(self, kind, prompt, rng, start) -> None:
        wanted = rng.randint(4, 32)
        async with self.http.post(f"{HTTP}/v1/completions", json={"model": self.model, "prompt": prompt,
                                                                  "max_tokens": wanted, "ignore_eos": True}) as r:
            body = await r.json(content_type=None)
        if r.status == 503 and self.started_on_the_killed_replica(start):
            return self.note(kind, "503", True)
        ok = r.status == 200 and body["usage"]["completion_tokens"] == wanted
        self.note(kind, str(r.status), ok, json.dumps(body)[:300])

    async def http_chat_stream(self, kind, prompt, rng, start) -> None:
        wanted = rng.randint(4, 32)
        request = {"model": self.model, "messages": [{"role": "user", "content": f"Say {len(prompt)} words"}],
                   "max_tokens": wanted, "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True}}
        async with self.http.post(f"{HTTP}/v1/chat/completions", json=request) as r:
            if r.status != 200:
                body = await r.text()
                return self.note(kind, str(r.status), r.status == 503 and self.started_on_the_killed_replica(start),
                                 body[:300])
            events = [line[6:] async for line in _lines(r.content) if line.startswith("data: ")]
        usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
        if events[-1] != "[DONE]" or not usage:
            # a stream that had started when its replica died ends with an error event
            started = self.started_on_the_killed_replica(start) and any("error" in e for e in events)
            return self.note(kind, "stream ended by an error", started, events[-1][:300] if events else "")
        self.note(kind, "ok", usage[-1]["completion_tokens"] == wanted)

    async def cancel(self, kind, prompt, rng, start) -> None:
        from pagedserve.client import Unavailable

        stream = self.grpc.stream(prompt, max_tokens=200, ignore_eos=True)
        try:
            async for _ in stream:
                break
        except Unavailable:
            return self.note(kind, "UNAVAILABLE", self.started_on_the_killed_replica(start))
        finally:
            await stream.aclose()
        self.note(kind, "cancelled by the client", True)

    async def deadline(self, kind, prompt, rng, start) -> None:
        from pagedserve.client import DeadlineExceeded, PagedServeError

        timeout = rng.uniform(0.05, 0.3)
        try:
            await self.grpc.generate(prompt, max_tokens=400, ignore_eos=True, timeout=timeout)
        except DeadlineExceeded:
            return self.note(kind, "DEADLINE_EXCEEDED", time.monotonic() - start < timeout + 2.0)
        except PagedServeError as e:
            return self.note(kind, type(e).__name__, False, str(e))
        self.note(kind, "ok", True)

    async def bad_input(self, kind, prompt, rng, start) -> None:
        from pagedserve.client import InvalidArgument, PagedServeError

        case = self.bad_sent % (len(HTTP_CASES) + len(GRPC_CASES))
        self.bad_sent += 1
        if case < len(HTTP_CASES):
            route, body, field = HTTP_CASES[case]
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with self.http.post(f"{HTTP}{route}", data=data, headers={"Content-Type": "application/json"}) as r:
                text = await r.text()
            return self.note("bad_input http", str(r.status), 400 <= r.status < 500, f"{route} {body!r} {text}")
        kwargs, field = GRPC_CASES[case - len(HTTP_CASES)]
        try:
            await self.grpc.generate("hi", **kwargs)
        except InvalidArgument:
            return self.note("bad_input grpc", "INVALID_ARGUMENT", True)
        except PagedServeError as e:
            return self.note("bad_input grpc", type(e).__name__, False, f"{kwargs!r} {e}")
        self.note("bad_input grpc", "ok", False, f"{kwargs!r} was served")


async def _lines(content):
    async for raw in content:
        line = raw.decode().strip()
        if line:
            yield line


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def processes() -> dict[int, str]:
    """Ray's processes on this machine: the replicas, their workers, the ingress, Serve's proxy and controller (by
    their process titles, `ray::<class>`, less the method running now), the raylet and the GCS; pid to name."""
    named = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if title.startswith("ray::") and "IDLE" not in title:
            # "ray::ServeReplica:soak:ModelServer.handle_request", "ray::SERVE_REPLICA::...:ServeReplica:..."
            name = title.split()[0].split(".")[0]
            named[int(proc.name)] = "ray::" + name[name.find("ServeReplica:"):] if "ServeReplica:" in name else name
        elif Path(title).name in ("raylet", "gcs_server"):
            named[int(proc.name)] = Path(title).name
    return named


async def sample_memory(soak: Soak, samples: dict[str, list[tuple[int, float]]], every: float,
                        done: asyncio.Event) -> None:
    while not done.is_set():
        for pid, name in processes().items():
            rss = rss_mb(pid)
            if rss is not None:
                samples.setdefault(f"{name} (pid {pid})", []).append((soak.answered, rss))
        try:
            await asyncio.wait_for(done.wait(), timeout=every)
        except TimeoutError:
            pass


def trends(samples: dict[str, list[tuple[int, float]]], total: int) -> list[dict]:
    """Per process: RSS at its first and last sample once it has seen a fifth of the run's requests (its warm-up:
    a replica started mid-way loads its model first), and the slope of a line fit through those samples, MB per
    1,000 requests."""
    rows = []
    for name, points in sorted(samples.items()):
        kept = [(n, mb) for n, mb in points if n >= points[0][0] + total / 5]
        if len(kept) < 3 or kept[-1][0] == kept[0][0]:
            continue
        n, mb = np.array(kept, dtype=float).T
        slope = float(np.polyfit(n / 1000, mb, 1)[0])
        rows.append({"process": name, "samples": len(kept), "first_mb": float(mb[0]), "last_mb": float(mb[-1]),
                     "max_mb": float(mb.max()), "mb_per_1000_requests": slope, "requests_seen": int(n[-1] - n[0])})
    return rows


async def run(args) -> dict:
    import aiohttp
    import ray

    from pagedserve.client import AsyncClient
    from pagedserve.serving.model_server import replica_actor_names

    rng = random.Random(args.seed)
    async with AsyncClient(GRPC, application=APP, timeout=120, max_retries=0) as grpc_client, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        soak = Soak(grpc_client, http)
        async with http.get(f"{HTTP}/v1/models") as r:
            soak.model = (await r.json())["data"][0]["id"]
        samples: dict[str, list[tuple[int, float]]] = {}
        done = asyncio.Event()
        sampler = asyncio.create_task(sample_memory(soak, samples, args.sample_s, done))
        seeds = [rng.randrange(2**32) for _ in range(args.requests)]
        sent = iter(range(args.requests))
        killed: dict[str, str] = {}

        async def client() -> None:  # one of `concurrency`: a request at a time, until all are sent
            for i in sent:
                if i == args.requests // 2:
                    name = sorted(replica_actor_names(APP))[0]
                    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
                    soak.killed_at, killed["replica"] = time.monotonic(), name
                await soak.one(random.Random(seeds[i]))

        start = time.monotonic()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        wall = time.monotonic() - start
        done.set()
        await sampler
    return {"soak": soak, "samples": samples, "wall_s": wall, "killed": killed.get("replica")}


def blocks_left(timeout: float = 120) -> dict[str, dict]:
    """What each replica still holds once both run again (the killed one's successor started): nothing, or its
    numbers."""
    from ray import serve

    from pagedserve.serving.model_server import replica_stats

    deadline = time.monotonic() + timeout
    held: dict[str, dict] = {"no replicas": {}}
    while time.monotonic() < deadline:
        deployment = serve.status().applications[APP].deployments["ModelServer"]
        if deployment.replica_states.get("RUNNING", 0) == 2:
            stats = replica_stats(APP)
            held = {n: {k: s[k] for k in ("num_free_blocks", "num_total_blocks", "num_running", "num_waiting")}
                    for n, s in stats.items() if s["num_free_blocks"] != s["num_total_blocks"]
                    or s["num_running"] or s["num_waiting"]}
            if not held:
                break
        time.sleep(0.5)
    return held


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=2.0, help="how often each process's RSS is read")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    env = announce()

    import ray
    from ray import serve

    from pagedserve.serving.serve_app import build_app

    config = yaml.safe_load(CONFIG.read_text())
    with tempfile.TemporaryDirectory() as model_dir:
        args.model = tiny_model(Path(model_dir))
        ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
        serve.start(http_options={"host": "127.0.0.1", "port": 8000}, grpc_options=config["grpc_options"])
        try:
            serve.run(build_app({"model": args.model, "max_model_len": 512, "kv_cache_memory": 64 << 20,
                                 "num_replicas": 2, "worker_cpus": 1, "max_num_seqs": 16,
                                 "max_waiting_requests": 4 * args.concurrency}), name=APP, route_prefix="/")
            result = asyncio.run(run(args))
            leaked = blocks_left()
        finally:
            serve.shutdown()
            ray.shutdown()
    soak: Soak = result["soak"]
    memory = trends(result["samples"], args.requests)
    summary = {"environment": env, "requests": args.requests, "concurrency": args.concurrency,
               "wall_s": result["wall_s"], "requests_per_s": args.requests / result["wall_s"],
               "killed_replica": result["killed"], "outcomes": dict(sorted(soak.outcomes.items())),
               "unclean": soak.unclean, "bad_input_kinds": len(HTTP_CASES) + len(GRPC_CASES),
               "leaked": leaked, "memory": memory, "rss_samples": result["samples"]}
    print(json.dumps({k: v for k, v in summary.items() if k not in ("memory", "rss_samples")}, indent=1))
    print("\n| process | samples | RSS first (MB) | RSS last (MB) | RSS max (MB) | trend (MB / 1,000 requests) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for row in memory:
        print(f"| {row['process']} | {row['samples']} | {row['first_mb']:.0f} | {row['last_mb']:.0f} | "
              f"{row['max_mb']:.0f} | {row['mb_per_1000_requests']:+.2f} |")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    if soak.unclean or leaked or soak.answered != args.requests:
        sys.exit(f"not clean: {len(soak.unclean)} unclean outcomes, blocks held {leaked}, "
                 f"{soak.answered} of {args.requests} answered")


if __name__ == "__main__":
    main()
