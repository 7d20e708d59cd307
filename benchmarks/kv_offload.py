"""The prefix cache's second tier beside the KV pool alone, in the same run, on the embedded SmolLM2.

  python benchmarks/kv_offload.py [--documents 8] [--document-tokens 512] [--pool-blocks 64] [--rounds 3]
                                  [--device cuda] [--json F]

A working set four times the pool by default: `documents` long prefixes (random tokens of the vocabulary), each
followed by a short question of its own in turn, round robin, one request at a time, so that every document has
been evicted from the pool by its next turn. Each request generates one token: its time is its time to first
token. The same requests run with the pool alone, then with a second tier that holds every document (a file on
local disk on a CPU, pinned host memory beside a CUDA pool). Prints the prefix cache's hit rate (and the tier's
share of it) and the TTFT of the rounds after the first (mean, p50, p99) of each, and the ratio; the first tokens
must be the same.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from environment import announce  # noqa: E402

BLOCK_SIZE = 16


def workload(documents: int, document_tokens: int, rounds: int, vocab: int) -> list[list[int]]:
    """Prompts in the order they are sent: round r asks every document its r-th question (8 tokens)."""
    rng = random.Random(0)
    docs = [[rng.randrange(100, vocab) for _ in range(document_tokens)] for _ in range(documents)]
    return [doc + [rng.randrange(100, vocab) for _ in range(8)] for _ in range(rounds) for doc in docs]


def run(prompts: list[list[int]], documents: int, settings: dict) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(**settings)
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([{"prompt_token_ids": [5] * 40}], params)  # warm-up: kernels built, nothing of the workload cached
    ttft, first = [], []
    for prompt in prompts:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
        ttft.append(time.perf_counter() - t0)
        first.append(out.outputs[0].token_ids[0])
    stats = llm.stats()
    llm.shutdown()
    later = sorted(ttft[documents:])  # the rounds after the first: every document seen before
    return {"tier": settings.get("kv_offload_disk") or settings.get("kv_offload_memory"),
            "hit_rate": stats["prefix_cache_hits"] / stats["prefix_cache_queries"],
            "tier_hit_rate": stats.get("offload_hits", 0) / stats["prefix_cache_queries"],
            "ttft_mean_s": statistics.fmean(later), "ttft_p50_s": later[len(later) // 2],
            "ttft_p99_s": later[min(len(later) - 1, round(0.99 * (len(later) - 1)))],
            "first_tokens": first, "restored_blocks": stats.get("offload_restored_blocks", 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--document-tokens", type=int, default=512)
    p.add_argument("--pool-blocks", type=int, default=64, help="the KV pool's blocks (of 16 tokens)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    env = announce()
    import torch

    from pagedserve.config import EngineConfig
    from pagedserve.workers.kv_pool import bytes_per_block
    from pagedserve.workers.loader import resolve_model
    from pagedserve.workers.models.model_config import ModelConfig

    config = ModelConfig.from_file(resolve_model(None).config_path)
    device = torch.device(args.device)
    dtype = EngineConfig(dtype=args.dtype, device=args.device).torch_dtype(device, config.torch_dtype)
    per_block = bytes_per_block(config, BLOCK_SIZE, dtype)
    blocks_per_document = -(-(args.document_tokens + 8) // BLOCK_SIZE)
    tier_bytes = 2 * args.documents * blocks_per_document * per_block  # room for every document, and to spare
    prompts = workload(args.documents, args.document_tokens, args.rounds, config.vocab_size)
    common = dict(device=args.device, dtype=args.dtype, block_size=BLOCK_SIZE, max_num_seqs=4,
                  kv_cache_memory=args.pool_blocks * per_block)
    with tempfile.TemporaryDirectory() as tmp:
        tier = ({"kv_offload_memory": tier_bytes} if device.type == "cuda"
                else {"kv_offload_disk": tier_bytes, "kv_offload_dir": tmp})
        rows = [run(prompts, args.documents, common), run(prompts, args.documents, {**common, **tier})]
    working_set = args.documents * blocks_per_document
    print(f"\n{args.documents} documents of {args.document_tokens} tokens ({working_set} blocks, "
          f"{working_set / args.pool_blocks:.1f}x the pool of {args.pool_blocks}), {args.rounds} rounds, one request "
          f"at a time, TTFT of rounds 2-{args.rounds}; same first tokens: "
          f"{'yes' if rows[0]['first_tokens'] == rows[1]['first_tokens'] else 'NO'}")
    print("| second tier | prefix-cache hit rate | from the tier | TTFT mean | p50 | p99 | TTFT vs the pool alone |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        name = "none" if row["tier"] is None else f"{next(iter(tier))[11:]} {row['tier'] / 2**20:.0f} MiB"
        print(f"| {name} | {row['hit_rate']:.1%} | {row['tier_hit_rate']:.1%} | {row['ttft_mean_s'] * 1e3:.1f} ms | "
              f"{row['ttft_p50_s'] * 1e3:.1f} ms | {row['ttft_p99_s'] * 1e3:.1f} ms | "
              f"{row['ttft_mean_s'] / rows[0]['ttft_mean_s']:.2f}x |")
    if args.json is not None:
        args.json.write_text(json.dumps({"environment": env, "args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
