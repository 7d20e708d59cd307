"""Multi-turn chat on several replicas: the prefix-aware router beside Serve's default router and beside one
replica, in one run, on the embedded SmolLM2-135M-Instruct, through the OpenAI chat route (streamed).

  scripts/loopback-netns.sh .venv/bin/python benchmarks/prefix_routing.py
  scripts/loopback-netns.sh .venv/bin/python benchmarks/prefix_routing.py --conversations 32 --turns 6 \\
      --system-words 150 --user-words 120 --output-tokens 32 --think-s 20 --out /tmp/prefix_routing.json

Every conversation shares one system prompt; they run at once, each sending its next turn (the whole
history: system, user and assistant messages) after a pause (its user reading and typing: exponential, mean
--think-s, also before the first turn, so conversations start spread out). Reported per setup:
the prefix-cache hit rate over all replicas (prompt tokens found cached / prompt tokens looked up), time to
first token p50/p99 (client side, to the first streamed content), and output tokens/s over the whole
workload. Each setup is a fresh Serve application, so every cache starts empty.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import numpy as np
from environment import announce

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river garden engine market window question answer "
         "city music letter winter summer morning paper table color story road island bridge forest machine "
         "mountain village report language energy science history nature kitchen picture country doctor "
         "teacher student station signal circle square pattern measure system program").split()

SETUPS = {
    "2 replicas, prefix-aware router": {"num_replicas": 2, "prefix_routing": True},
    "2 replicas, Serve's default router": {"num_replicas": 2, "prefix_routing": False},
    "1 replica": {"num_replicas": 1},
}
HTTP_PORT = 8000


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def conversation(client, model: str, system: str, index: int, args) -> tuple[list[float], int, int]:
    """One conversation's turns in order: (TTFT of each turn, output tokens, prompt tokens)."""
    rng = random.Random(index)
    messages = [{"role": "system", "content": system}]
    ttfts: list[float] = []
    output_tokens = prompt_tokens = 0
    for _ in range(args.turns):
        await asyncio.sleep(rng.expovariate(1 / args.think_s) if args.think_s else 0)  # the user reads, types
        messages.append({"role": "user", "content": f"Conversation {index}. " + words(rng, args.user_words)})
        start = time.perf_counter()
        first = None
        text = []
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=args.output_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter() - start
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                output_tokens += chunk.usage.completion_tokens
                prompt_tokens += chunk.usage.prompt_tokens
        ttfts.append(first if first is not None else time.perf_counter() - start)
        messages.append({"role": "assistant", "content": "".join(text)})
    return ttfts, output_tokens, prompt_tokens


async def workload(args) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key="none", max_retries=0, timeout=1800)
    model = (await client.models.list()).data[0].id
    system = "You are a helpful assistant. " + words(random.Random(-1), args.system_words)
    start = time.perf_counter()
    results = await asyncio.gather(*(conversation(client, model, system, i, args)
                                     for i in range(args.conversations)))
    wall = time.perf_counter() - start
    await client.close()
    ttfts = np.array([t for r in results for t in r[0]]) * 1000
    output = sum(r[1] for r in results)
    return {"wall_s": wall, "output_tok_s": output / wall, "ttft_p50_ms": float(np.percentile(ttfts, 50)),
            "ttft_p99_ms": float(np.percentile(ttfts, 99)), "requests": len(ttfts),
            "mean_prompt_tokens": sum(r[2] for r in results) / len(ttfts)}


def run_setup(name: str, settings: dict, args) -> dict:
    from ray import serve

    from pagedserve.serving.model_server import replica_stats
    from pagedserve.serving.serve_app import build_app

    serve.run(build_app({"max_model_len": 4096, "kv_cache_memory": args.kv_cache_gib << 30, **settings}),
              name="bench", route_prefix="/")
    try:
        result = asyncio.run(workload(args))
        stats = replica_stats("bench").values()
        queries = sum(s["prefix_cache_queries"] for s in stats)
        hits = sum(s["prefix_cache_hits"] for s in stats)
        result |= {"setup": name, "hit_rate": hits / queries if queries else 0.0,
                   "per_replica_prompt_tokens": sorted(s["prefix_cache_queries"] for s in stats)}
    finally:
        serve.delete("bench")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=150)
    p.add_argument("--user-words", type=int, default=120)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--think-s", type=float, default=20.0,
                   help="mean pause before each turn (exponential; 0: each turn right after the last answer)")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="KV pool per replica")
    p.add_argument("--imbalance-threshold", type=int, help="the prefix-aware router's (default: its own)")
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    env = announce()

    import ray
    from ray import serve

    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT})
    rows = []
    try:
        for name in args.setups:
            settings = dict(SETUPS[name])
            if settings.get("prefix_routing") and args.imbalance_threshold is not None:
                settings["prefix_routing"] = {"imbalance_threshold": args.imbalance_threshold}
            rows.append(run_setup(name, settings, args))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print("\n| setup | prefix-cache hit rate | TTFT p50 (ms) | TTFT p99 (ms) | output tokens/s | wall (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['setup']} | {100 * r['hit_rate']:.1f}% | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
              f"{r['output_tok_s']:.1f} | {r['wall_s']:.0f} |")
    if args.out:
        args.out.write_text(json.dumps({"environment": env, "setups": rows}, indent=1))


if __name__ == "__main__":
    main()
