"""What serving costs per streamed message: many streams through the Serve app (engine replica -> ingress ->
HTTP proxy -> client) on a model whose steps are short, as a small model's are on a GPU, at several
`stream_interval_ms` settings, beside the same engine offline on the same Ray worker.

The model is a 2-layer, 64-wide random Llama with a 4,096-token vocabulary and a synthetic tokenizer
(benchmarks/synthetic_tokenizer.py), so a decode step of 64 sequences takes milliseconds on a CPU and what
is measured is the serving path: each stream is an OpenAI streaming completion over HTTP on 127.0.0.1
(Serve's gRPC proxy is not started), `ignore_eos`, all streams from one aiohttp client process.

  python benchmarks/served_streams.py [--streams 64] [--requests 128] [--output-tokens 128] \\
      [--intervals 0 50 100 200] [--rounds 1]

Per interval: output tokens/s at the client, stream messages (SSE chunks with tokens) and tokens per message,
time to first token (p50), and the CPU seconds each Ray process spent during the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from environment import announce  # noqa: E402
from host_overhead import tiny_model_config  # noqa: E402

PORT = 8000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=64, help="concurrent streams (and max_num_seqs)")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--intervals", type=float, nargs="+", default=[0, 50, 100, 200], help="stream_interval_ms values")
    p.add_argument("--rounds", type=int, default=1, help="passes over --intervals, alternating")
    p.add_argument("--json", type=Path, default=None, help="the run's description and results here too")
    args = p.parse_args()
    env = announce()

    import ray
    from ray import serve

    from pagedserve import LLM, SamplingParams
    from pagedserve.serving.serve_app import build_app

    model = tiny_model_config(vocab=4096)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    settings = dict(model=model, max_num_seqs=args.streams, kv_cache_memory=256 << 20)
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    try:
        llm = LLM(**settings, executor="ray")  # the ceiling: the same engine and worker actor, no streams
        params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
        llm.generate(prompts[:4], params)
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        offline = args.requests * args.output_tokens / (time.perf_counter() - t0)
        llm.shutdown()
        print(f"offline, LLM(executor='ray'): {offline:.0f} output tokens/s")
        rows = []

        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        print("| stream_interval_ms | output tokens/s | x offline | messages | tokens/message | TTFT p50 ms | "
              "CPU s: engine replica, ingress, proxy, worker |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for _ in range(args.rounds):
            for interval in args.intervals:
                serve.run(build_app(dict(settings, stream_interval_ms=interval)), name="pagedserve",
                          route_prefix="/")
                model_id = asyncio.run(served_model_id())
                before = ray_cpu_seconds()
                r = asyncio.run(run_streams(model_id, prompts, args))
                cpu = [(title, t - before.get(pid, ("", 0.0))[1]) for pid, (title, t) in ray_cpu_seconds().items()]
                roles = ("ModelServer", "Ingress", "ProxyActor", "WorkerActor")
                cpu_by_role = {role: sum(t for title, t in cpu if role in title) for role in roles}
                cpu_text = ", ".join(f"{t:.1f}" for t in cpu_by_role.values())
                rows.append({"stream_interval_ms": interval, "tokens_per_s": r["tokens_per_s"],
                             "x_offline": r["tokens_per_s"] / offline, "messages": r["messages"],
                             "tokens": r["tokens"], "ttft_p50_ms": r["ttft_p50"] * 1e3, "cpu_s": cpu_by_role})
                print(f"| {interval:g} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / offline:.2f} | "
                      f"{r['messages']} | {r['tokens'] / r['messages']:.1f} | {r['ttft_p50'] * 1e3:.0f} | "
                      f"{cpu_text} |", flush=True)
                serve.delete("pagedserve")
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "args": vars(args) | {"json": str(args.json)},
                                         "offline_tokens_per_s": offline, "served": rows}, indent=2))


async def served_model_id() -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{PORT}/v1/models") as r:
        return (await r.json())["data"][0]["id"]


async def run_streams(model_id: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Every prompt as a streamed completion, `args.streams` at a time; one warm-up request first."""
    import aiohttp

    counts = {"tokens": 0, "messages": 0}
    ttfts: list[float] = []

    async def one(session: aiohttp.ClientSession, prompt: list[int], record: bool) -> None:
        body = dict(model=model_id, prompt=prompt, max_tokens=args.output_tokens, temperature=0, ignore_eos=True,
                    stream=True, stream_options={"include_usage": True})
        start = time.perf_counter()
        first = True
        async with session.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and record:
                    counts["messages"] += 1
                    if first:
                        ttfts.append(time.perf_counter() - start)
                        first = False
                if chunk.get("usage") and not chunk["choices"] and record:
                    counts["tokens"] += chunk["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await one(session, prompts[0], record=False)
        limit = asyncio.Semaphore(args.streams)

        async def bounded(prompt: list[int]) -> None:
            async with limit:
                await one(session, prompt, record=True)

        t0 = time.perf_counter()
        await asyncio.gather(*(bounded(p) for p in prompts))
        elapsed = time.perf_counter() - t0
    if counts["tokens"] != len(prompts) * args.output_tokens:
        raise RuntimeError(f"{counts['tokens']} tokens arrived, not {len(prompts) * args.output_tokens}")
    return dict(counts, tokens_per_s=counts["tokens"] / elapsed, ttft_p50=statistics.median(ttfts))


def ray_cpu_seconds() -> dict[int, tuple[str, float]]:
    """Each Ray worker process's title (ray::...) and CPU seconds (user + system) so far, by pid."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        cmdline = proc.info["cmdline"] or []
        if cmdline and cmdline[0].startswith("ray::"):
            t = proc.info["cpu_times"]
            out[proc.pid] = (cmdline[0], t.user + t.system)
    return out


if __name__ == "__main__":
    main()
