"""Does launching a step ever wait for the GPU? With async scheduling the host launches step N+1 while
step N runs; any operation in the launch that synchronizes with the device (a `.item()`, a blocking
host-to-device copy, `unique`, `nonzero`, ...) makes the GPU idle until the host catches up.

Two checks per sampling mix, on CUDA:

- torch's sync debug mode ("error"): the first operation that torch knows synchronizes fails the step
  with its name.
- a busy device: with a long kernel queued ahead of it, one engine step (launch the next step, read the
  last one's draws, process them) must return long before the kernel ends. This also catches waits that
  torch does not see, such as a copy from pageable host memory that the driver makes wait for the stream.

Exit status 0 when no mix waits for the device. Needs only torch, triton and transformers.

    PYTHONPATH=. python benchmarks/gpu_syncs.py [--cuda-graphs]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from environment import announce  # noqa: E402
from throughput import make_random_checkpoint, make_workload  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.engine.request_errors import RequestFailed  # noqa: E402

MIXES = {
    "greedy": dict(temperature=0),
    "top-p, seeded": dict(temperature=0.8, top_p=0.9, seed=1),
    "top-k, min-p": dict(temperature=1.0, top_k=20, min_p=0.05),
    "logprobs": dict(temperature=0.7, logprobs=5),
    "prompt logprobs": dict(temperature=0, prompt_logprobs=3),
    "n=2": dict(temperature=1.0, n=2),
    "penalties": dict(temperature=0, repetition_penalty=1.2, frequency_penalty=0.3),
    "logit_bias, min_tokens": dict(temperature=0, logit_bias={5: 2.0}, min_tokens=8, stop_token_ids=[7]),
    "allowed_token_ids": dict(temperature=0.7, allowed_token_ids=list(range(100, 1100))),
}

BUSY_MS = 200  # the kernel queued ahead of the step in the busy-device check


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--cuda-graphs", action="store_true")
    args = p.parse_args()
    announce()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    model_dir = make_random_checkpoint(args.preset, torch.bfloat16, "cuda")
    prompts, _ = make_workload(32, (16, 200), (1, 1), 100_000, seed=0)
    cycles_per_ms = sleep_cycles_per_ms()
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
            step_ms = step_behind_busy_device(llm.llm_engine, prompts, params, cycles_per_ms)
            waited = step_ms > BUSY_MS / 2
            failed += waited
            print(f"{name:24s} a step with the device busy for {BUSY_MS} ms took {step_ms:.1f} ms: "
                  f"{'WAITS FOR THE DEVICE' if waited else 'no wait'}")
    return 1 if failed else 0



def sleep_cycles_per_ms() -> float:
    """GPU clock cycles that `torch.cuda._sleep` spins per millisecond, timed with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / start.elapsed_time(end)


def step_behind_busy_device(engine, prompts, params, cycles_per_ms: float) -> float:
    """Milliseconds one engine step takes once a BUSY_MS kernel is queued after the step in flight (the
    next step's launch goes behind it; the draws it reads come before it). The requests run to the end."""
    for p in prompts:
        engine.add_request(p, params)
    for _ in range(6):  # prefilled, decoding, a step in flight
        engine.step()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(BUSY_MS * cycles_per_ms))
    t0 = time.perf_counter()
    engine.step()
    elapsed = (time.perf_counter() - t0) * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


if __name__ == "__main__":
    sys.exit(main())
