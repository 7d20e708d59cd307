"""Per-step dispatch overhead: engine -> worker actors -> sampled tokens back, on CPU with a tiny model.

The model is so small that a step's compute is ~1 ms; the difference between a Ray executor and the
in-process one is what dispatch costs. Compares RayExecutor's two paths: plain actor calls (ray.put
once + .remote per rank) and a Ray compiled graph (ray.dag, shared-memory channels). Then whole
`LLMEngine.step` calls with async scheduling off and on: scheduled ahead, the next step is sent while
the worker computes the one before it, so the engine's work and the dispatch overlap the worker's.

  python benchmarks/dispatch.py [--steps 200] [--tp 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from environment import announce  # noqa: E402

TINY = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def step_times(engine, steps: int, whole: bool = False) -> list[float]:
    """Seconds per decode step of one running request (batch of one row), after warm-up: the executor's
    launch to draws, or (`whole`) the whole `engine.step()`."""
    from pagedserve import SamplingParams

    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True))
    times = []
    for i in range(steps + 10):
        if whole:
            t0 = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - t0
        else:
            batch = engine.scheduler.schedule()
            t0 = time.perf_counter()
            output = engine.executor.collect(engine.executor.launch(batch))
            elapsed = time.perf_counter() - t0
            engine._process(batch, output)
        if i >= 10:
            times.append(elapsed)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    env = announce()

    import ray

    from pagedserve import LLMEngine
    from pagedserve.config import EngineConfig
    from pagedserve.executors import ray_executor

    cfg_path = Path(tempfile.mkdtemp()) / "config.json"
    cfg_path.write_text(json.dumps(TINY))
    model = f"random:{cfg_path}"
    ray.init(num_cpus=max(4, max(args.tp) + 1), include_dashboard=False)

    rows, whole = [], []
    local = LLMEngine(EngineConfig(model=model, kv_cache_memory="64MiB"))
    base = statistics.median(step_times(local, args.steps))
    rows.append(("in-process (LocalExecutor)", 1, base))
    for tp in args.tp:
        for compiled in (False, True):
            ray_executor.USE_COMPILED_GRAPH = compiled
            name = "Ray compiled graph (ray.dag)" if compiled else "Ray actor calls: ray.put + .remote per rank"
            times = {}
            for async_scheduling in (False, True):
                engine = LLMEngine(EngineConfig(model=model, kv_cache_memory="64MiB", executor="ray",
                                                tensor_parallel_size=tp, async_scheduling=async_scheduling))
                assert (engine.executor.compiled is not None) == compiled
                assert engine.schedules_ahead == async_scheduling
                if not async_scheduling:
                    rows.append((name, tp, statistics.median(step_times(engine, args.steps))))
                times[async_scheduling] = statistics.median(step_times(engine, args.steps, whole=True))
                engine.shutdown()
            whole.append((name, tp, times[False], times[True]))
    ray.shutdown()

    print(f"\n{args.steps} decode steps of one row, tiny model, median per step\n")
    print("| path | tp | step ms | overhead vs in-process ms |\n| --- | ---: | ---: | ---: |")
    for name, tp, t in rows:
        print(f"| {name} | {tp} | {t * 1e3:.2f} | {(t - base) * 1e3:+.2f} |")
    print("\n| whole `LLMEngine.step` | tp | async scheduling off ms | on ms | off / on |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, tp, off, on in whole:
        print(f"| {name} | {tp} | {off * 1e3:.2f} | {on * 1e3:.2f} | {off / on:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"environment": env,
                                         "dispatch": [{"path": n, "tp": tp, "step_s": t} for n, tp, t in rows],
                                         "whole_step": [{"path": n, "tp": tp, "sync_s": off, "async_s": on}
                                                        for n, tp, off, on in whole]}, indent=2))


if __name__ == "__main__":
    main()
