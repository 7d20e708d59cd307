"""Does launching a step ever wait for the GPU? With async scheduling the host launches step N+1 while
step N runs; any operation in the launch that synchronizes with the device (a `.item()`, a blocking
host-to-device copy, `unique`, `nonzero`, ...) makes the GPU idle until the host catches up.

Runs engine steps on CUDA under `torch.cuda.set_sync_debug_mode("error")`, one sampling mix at a time,
so that the first synchronizing operation fails the step with its name; prints each mix's verdict.
Exit status 0 when no mix synchronizes. Needs only torch, triton and transformers.

    PYTHONPATH=. python benchmarks/gpu_syncs.py [--cuda-graphs]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from throughput import make_random_checkpoint, make_workload  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.engine import RequestFailed  # noqa: E402

MIXES = {
    "greedy": dict(temperature=0),
    "top-p, seeded": dict(temperature=0.8, top_p=0.9, seed=1),
    "top-k, min-p": dict(temperature=1.0, top_k=20, min_p=0.05),
    "logprobs": dict(temperature=0.7, logprobs=5),
    "prompt logprobs": dict(temperature=0, prompt_logprobs=3),
    "n=2": dict(temperature=1.0, n=2),
    "penalties": dict(temperature=0, repetition_penalty=1.2, frequency_penalty=0.3),
    "logit_bias, min_tokens": dict(temperature=0, logit_bias={5: 2.0}, min_tokens=8, stop_token_ids=[7]),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--cuda-graphs", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    model_dir = make_random_checkpoint(args.preset, torch.bfloat16, "cuda")
    prompts, _ = make_workload(32, (16, 200), (1, 1), 100_000, seed=0)
    failed = 0
    with LLM(str(model_dir), dtype="bfloat16", cuda_graphs=args.cuda_graphs, kv_cache_memory="4GiB") as llm:
        for name, kw in MIXES.items():
            params = SamplingParams(max_tokens=24, ignore_eos=True, **kw)
            llm.generate(prompts, params)  # warm-up: compiles, allocates, captures
            torch.cuda.set_sync_debug_mode("error")
            try:
                llm.generate(prompts, params)
                print(f"{name:24s} no synchronizing operation")
            except RequestFailed as e:
                failed += 1
                print(f"{name:24s} SYNCHRONIZES: {e}")
            finally:
                torch.cuda.set_sync_debug_mode("default")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
