"""Disaggregated prefill beside colocated replicas on the same resources, on a mixed workload: one prefill replica
and one decode replica (`prefill` in deploy/config.yaml) against two replicas that each prefill and decode (routed by
prefix), every worker on one CPU of its own, in one run, on the embedded SmolLM2-135M-Instruct, streamed over gRPC.

  scripts/loopback-netns.sh .venv/bin/python benchmarks/prefill_split.py
  scripts/loopback-netns.sh .venv/bin/python benchmarks/prefill_split.py --requests 64 --rate 0.5 \\
      --long-share 0.25 --long-tokens 1536 --short-tokens 64 --output-tokens 64 --out /tmp/prefill_split.json

Requests arrive at random (exponential gaps, mean 1 / --rate), each a prompt of random token ids: a long one
(--long-tokens) with probability --long-share, else a short one; every request decodes --output-tokens tokens
(ignore_eos, greedy). Reported per setup: time to first token and inter-token latency (the gaps between a stream's
tokens after its first) p50 and p99, client side, the longest gaps (p99.9, the longest, how many over a second: a
stream stalled behind another request's prefill), and output tokens/s over the workload. Each setup is a fresh Serve
application; streams send every step's tokens (`stream_interval_ms` 0), so that the gaps are the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import numpy as np
import yaml
from environment import announce

CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "config.yaml"
GRPC = "127.0.0.1:9000"
SETUPS = {
    "2 replicas, colocated": {"num_replicas": 2},
    "1 prefill + 1 decode replica": {"num_replicas": 1, "prefill": {"num_replicas": 1}},
}
VOCAB = range(100, 49_000)  # SmolLM2's ordinary tokens


async def one(client, prompt: list[int], delay: float, args) -> tuple[float, list[float]]:
    """One request after `delay`: its TTFT and its inter-token gaps (s)."""
    await asyncio.sleep(delay)
    start = last = time.perf_counter()
    ttft, gaps, received = None, [], 0
    async for chunk in client.stream(prompt, max_tokens=args.output_tokens, temperature=0, ignore_eos=True):
        now = time.perf_counter()
        if not chunk.token_ids:
            continue
        if ttft is None:
            ttft = now - start
            gaps += [0.0] * (len(chunk.token_ids) - 1)  # tokens that came with the first (none at interval 0)
        else:
            gaps += [(now - last) / len(chunk.token_ids)] * len(chunk.token_ids)
        last = now
        received += len(chunk.token_ids)
    assert received == args.output_tokens, received
    return ttft, gaps


async def workload(args) -> dict:
    from pagedserve.client import AsyncClient

    rng = random.Random(0)
    prompts, delays, at = [], [], 0.0
    for _ in range(args.requests):
        n = args.long_tokens if rng.random() < args.long_share else args.short_tokens
        prompts.append([rng.choice(VOCAB) for _ in range(n)])
        at += rng.expovariate(args.rate)
        delays.append(at)
    async with AsyncClient(GRPC, application="bench", timeout=1800, max_retries=0) as client:
        await client.generate(prompts[0][:8], max_tokens=2)  # a first call: connections made, not measured
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, p, d, args) for p, d in zip(prompts, delays, strict=True)))
        wall = time.perf_counter() - start
    ttfts = np.array([r[0] for r in results]) * 1000
    gaps = np.array([g for r in results for g in r[1]]) * 1000
    return {"wall_s": wall, "output_tok_s": args.requests * args.output_tokens / wall,
            "ttft_p50_ms": float(np.percentile(ttfts, 50)), "ttft_p99_ms": float(np.percentile(ttfts, 99)),
            "itl_p50_ms": float(np.percentile(gaps, 50)), "itl_p99_ms": float(np.percentile(gaps, 99)),
            "itl_p999_ms": float(np.percentile(gaps, 99.9)), "itl_max_ms": float(gaps.max()),
            "gaps_over_1s": int((gaps > 1000).sum()), "gaps": int(gaps.size),
            "requests": args.requests, "prompt_tokens": sum(map(len, prompts))}


def run_setup(name: str, settings: dict, args) -> dict:
    from ray import serve

    from pagedserve.serving.serve_app import build_app

    serve.run(build_app({"max_model_len": 4096, "kv_cache_memory": args.kv_cache_gib << 30, "worker_cpus": 1,
                         "stream_interval_ms": 0, **settings}), name="bench", route_prefix="/")
    try:
        result = asyncio.run(workload(args))
        result["setup"] = name
        if "prefill" in settings:
            stats = serve.get_deployment_handle("ModelServer", "bench").stats.remote().result()
            result |= {"prefilled_elsewhere": stats["kv_transfer_imports"],
                       "prefill_failures": stats["kv_transfer_failures"]}
    finally:
        serve.delete("bench")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=0.5, help="requests per second (exponential gaps)")
    p.add_argument("--long-share", type=float, default=0.25)
    p.add_argument("--long-tokens", type=int, default=1536)
    p.add_argument("--short-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--kv-cache-gib", type=int, default=2, help="KV pool per replica")
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    env = announce()

    import ray
    from ray import serve

    config = yaml.safe_load(CONFIG.read_text())
    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    serve.start(http_options={"host": "127.0.0.1", "port": 8000}, grpc_options=config["grpc_options"])
    rows = []
    try:
        for name in args.setups:
            rows.append(run_setup(name, SETUPS[name], args))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print("\n| setup | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | ITL p99.9 (ms) | ITL max (ms) | "
          "gaps > 1 s | output tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['setup']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} | "
              f"{r['itl_p99_ms']:.1f} | {r['itl_p999_ms']:.0f} | {r['itl_max_ms']:.0f} | {r['gaps_over_1s']} of "
              f"{r['gaps']} | {r['output_tok_s']:.1f} |")
    if args.out:
        args.out.write_text(json.dumps({"environment": env, "setups": rows}, indent=1))


if __name__ == "__main__":
    main()
