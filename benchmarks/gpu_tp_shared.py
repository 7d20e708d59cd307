"""Tensor parallelism 2 on one GPU: two worker actors sharing it (gpus_per_worker=0.5, gloo between them), against
tensor parallelism 1 on the same random-weight model, greedy, in the same run.

  python benchmarks/gpu_tp_shared.py                                    # a GPU: Qwen2.5-0.5B shape, fp32 and bf16
  python benchmarks/gpu_tp_shared.py --device cpu --preset qwen2-tiny   # the script itself, on a CPU (TP over gloo)

In fp32 the two must give the same tokens (a split sum rounds differently, which a near-tie among the top logits can
flip: the first differing step of each prompt is printed); in bf16 rounding differs sooner, so the count of equal
prompts and the first differing steps are reported, not asserted. Exit status 1 when fp32 parts before
--fp32-min-equal steps in any prompt, or a run fails. The last line, `TP_SHARED: ...`, sums it up.

Both runs are eager (TP 2 on a shared GPU never replays CUDA graphs; TP 1 runs without them too, so that the same
kernels compute both), TP 1 in this process (the local executor) and TP 2 on two Ray worker actors. One checkpoint
in bf16 serves both dtypes (fp32 holds its values exactly), so that a GPU run spends its time comparing.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from environment import announce  # noqa: E402
from throughput import PRESETS, make_random_checkpoint  # noqa: E402


def greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int, **settings) -> tuple[list[list[int]], float]:
    """Each prompt's greedy tokens, and the seconds they took (after a warm-up step, without the load)."""
    from pagedserve import LLM, SamplingParams

    t0 = time.perf_counter()
    with LLM(str(model_dir), **settings) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
        loaded = time.perf_counter() - t0
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t1
    print(f"  tp {settings.get('tensor_parallel_size', 1)} on {settings['executor']}: load and warm-up "
          f"{loaded:.1f} s, {len(prompts)} prompts {elapsed:.2f} s", flush=True)
    return [list(o.outputs[0].token_ids) for o in outs], elapsed


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--fp32-min-equal", type=int, default=16, help="fp32 prompts must agree for this many steps")
    args = p.parse_args()
    announce()
    import ray

    started = time.perf_counter()
    if not ray.is_initialized():  # RAY_ADDRESS set: that cluster; else one of this machine's GPU and cores
        env = {"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}}
        if os.environ.get("RAY_ADDRESS"):
            ray.init(runtime_env=env)
        else:
            ray.init(num_cpus=max(4, os.cpu_count() or 1), num_gpus=1 if args.device == "cuda" else 0,
                     include_dashboard=False, runtime_env=env)
    model_dir = make_random_checkpoint(args.preset, torch.bfloat16, args.device)
    print(f"checkpoint ({args.preset}, bf16) and Ray ready in {time.perf_counter() - started:.1f} s", flush=True)
    vocab = PRESETS[args.preset]["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(5, 300))] for _ in range(args.num_prompts)]
    failed, summary = [], []
    try:
        for dtype_name in args.dtypes:
            common = dict(device=args.device, dtype=dtype_name, kv_cache_memory="2GiB", max_model_len=1024,
                          max_num_seqs=args.num_prompts, cuda_graphs=False)
            try:
                one, t1 = greedy(model_dir, prompts, args.max_tokens, executor="local", **common)
                shared = dict(common, executor="ray", tensor_parallel_size=2)
                if args.device == "cuda":
                    shared["gpus_per_worker"] = 0.5
                two, t2 = greedy(model_dir, prompts, args.max_tokens, **shared)
            except Exception as e:  # the other dtype still runs, and the summary says which failed
                print(f"{dtype_name}: failed: {type(e).__name__}: {e}", flush=True)
                failed.append(f"{dtype_name} ({type(e).__name__})")
                summary.append(f"{dtype_name} failed")
                continue
            firsts = [first_difference(a, b) for a, b in zip(one, two, strict=True)]
            equal = sum(f is None for f in firsts)
            print(f"{dtype_name}: TP 2 on one {args.device} ({'gloo' if args.device == 'cuda' else 'CPU slots'}) "
                  f"vs TP 1: {equal}/{len(prompts)} prompts equal over {args.max_tokens} tokens; first differing "
                  f"steps {[f for f in firsts if f is not None]}; {t2:.2f} s vs {t1:.2f} s", flush=True)
            summary.append(f"{dtype_name} {equal}/{len(prompts)} equal (TP 2 {t2:.2f} s, TP 1 {t1:.2f} s)")
            if dtype_name == "float32" and any(f is not None and f < args.fp32_min_equal for f in firsts):
                failed.append(f"{dtype_name} (differs before step {args.fp32_min_equal})")
    finally:
        ray.shutdown()
    verdict = "FAIL in " + ", ".join(failed) if failed else "ok"
    print(f"TP_SHARED: {verdict}; {'; '.join(summary)}; {time.perf_counter() - started:.0f} s in all", flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
