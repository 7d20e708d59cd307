"""What admitting an expensive request costs the requests already streaming: the served step loop
(`AsyncEngine`) with `--streams` sequences decoding, while `--heavy` requests arrive one after another,
each with a JSON schema of its own (a string of up to `--max-length` characters: xgrammar compiles it in
about a second, and a new schema misses the compile cache) and a text prompt of `--prompt-chars`
characters to tokenize.

Measured, over the window in which the heavy requests are admitted, and over as long a window before
them: the longest gap between two of the running streams' steps, and the longest time the event loop
did not run (a 5 ms ticker's worst lateness). Both grow by a compile's time wherever a request is
prepared on the event loop. The model is the 2-layer random Llama of `host_overhead.py`.

  python benchmarks/admission_stall.py [--streams 32] [--heavy 4] [--max-length 200000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from environment import announce  # noqa: E402
from host_overhead import random_prompts, tiny_model_config  # noqa: E402
from throughput import all_decoding  # noqa: E402

from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.engine.async_engine import AsyncEngine  # noqa: E402
from pagedserve.sampling_params import SamplingParams, StructuredOutputs  # noqa: E402


async def one_round(model: str, args: argparse.Namespace, round_index: int) -> dict[str, float]:
    core = AsyncEngine(EngineConfig(model=model, max_num_seqs=args.streams + args.heavy,
                                    max_num_batched_tokens=8192, kv_cache_memory="1GiB"))
    engine = core.llm_engine
    steps: list[float] = []  # each step's start, from the first step in which every stream decodes
    advance = engine.advance_async

    async def timed_advance():
        if steps or all_decoding(engine):
            steps.append(time.perf_counter())
        return await advance()

    engine.advance_async = timed_advance
    late: list[tuple[float, float]] = []  # (when, how late) for each tick of the ticker

    async def ticker() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            late.append((now, now - t - 0.005))

    async def stream(prompt: list[int]) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)  # outlasts the run
        async for _ in core.generate(prompt, params):
            pass

    prompts = random_prompts(argparse.Namespace(num_seqs=args.streams, prompt_len=(64, 256), seed=0))
    tasks = [asyncio.create_task(stream(p)) for p in prompts]
    tick = asyncio.create_task(ticker())
    while len(steps) < 5:  # every stream prefilled and decoding
        await asyncio.sleep(0.05)
        failed = next((t for t in tasks if t.done()), None)
        if failed is not None:
            raise RuntimeError("a stream ended before the measurement") from failed.exception()

    before = time.perf_counter()
    await asyncio.sleep(args.window)
    start = time.perf_counter()
    admitted: list[float] = []
    for i in range(args.heavy):
        # A schema no earlier round or request used: every one is compiled.
        schema = {"type": "string", "maxLength": args.max_length + 1000 * round_index + i}
        params = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=StructuredOutputs(
            json=json.dumps(schema)))
        t0 = time.perf_counter()
        async for _ in core.generate("word " * (args.prompt_chars // 5), params):
            pass
        admitted.append(time.perf_counter() - t0)
    end = time.perf_counter()
    for task in (*tasks, tick):
        task.cancel()
    await asyncio.gather(*tasks, tick, return_exceptions=True)
    core.shutdown()

    def longest_gap(lo: float, hi: float) -> float:
        inside = [t for t in steps if lo <= t <= hi]
        return max((b - a for a, b in zip(inside, inside[1:], strict=False)), default=float("nan"))

    def worst_late(lo: float, hi: float) -> float:
        return max((d for t, d in late if lo <= t <= hi), default=float("nan"))

    quiet = max(before, start - (end - start))
    return {"quiet_step_gap": longest_gap(quiet, start), "heavy_step_gap": longest_gap(start, end),
            "quiet_loop_late": worst_late(quiet, start), "heavy_loop_late": worst_late(start, end),
            "step_median": statistics.median(b - a for a, b in zip(steps, steps[1:], strict=False)),
            "heavy_request": statistics.median(admitted)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--heavy", type=int, default=4, help="expensive requests admitted one after another")
    p.add_argument("--max-length", type=int, default=200_000, help="the heavy schemas' string maxLength")
    p.add_argument("--prompt-chars", type=int, default=4_000, help="the heavy requests' text prompt length")
    p.add_argument("--window", type=float, default=3.0, help="seconds of quiet streaming measured first")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    announce()
    torch.set_num_threads(1)
    model = tiny_model_config()
    print(f"{args.streams} streams decoding; {args.heavy} requests each with a new schema (maxLength "
          f"~{args.max_length}) and a {args.prompt_chars}-character prompt, one after another (ms):")
    print("  round  step median  longest step gap quiet / heavy  loop's worst lateness quiet / heavy  "
          "heavy request median")
    for r in range(args.rounds):
        m = asyncio.run(one_round(model, args, r))
        print(f"  {r + 1:5d}  {m['step_median'] * 1e3:11.1f}  {m['quiet_step_gap'] * 1e3:15.1f} / "
              f"{m['heavy_step_gap'] * 1e3:7.1f}  {m['quiet_loop_late'] * 1e3:20.1f} / "
              f"{m['heavy_loop_late'] * 1e3:7.1f}  {m['heavy_request'] * 1e3:20.1f}")


if __name__ == "__main__":
    main()
