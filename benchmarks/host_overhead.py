"""Host-side cost of one decode step with many running sequences: the Python work around the model.

On a GPU a small model's decode step is short, so the scheduler, the batch's tensors and the output
bookkeeping can bound throughput. This times each phase of `LLMEngine.step` separately on a model so
small that its compute barely counts (2 layers, hidden 64, SmolLM2's 49k vocabulary, a synthetic
byte-level BPE tokenizer of that size):

  schedule  Scheduler.schedule (block allocation, the StepBatch)
  prepare   ModelRunner.prepare (positions, slot mapping, block-table tensor), timed on its own
  execute   the worker's whole step (prepare again, forward, logits, sampling)
  process   Scheduler.update, detokenization, RequestOutputs

Then whole `LLMEngine.step` calls, with async scheduling off (the phases one after another) and on (the
next step launched first, so the host work of one step overlaps the model's work of the next), on fresh
engines, alternately, `--rounds` times.

With `--streams MS [MS ...]`, instead: the served engine's step loop (`AsyncEngine`) with each sequence a
stream read as a Serve replica reads it (cut into deltas), one run per stream interval, and the engine
metrics when Ray is installed. Measured: the event loop's CPU time per step (the model runs in a thread
on a CPU; its time does not count), whole steps, and the outputs the streams send per step.

  python benchmarks/host_overhead.py [--num-seqs 256] [--steps 50] [--rounds 2] [--penalties] [--final-only]
  python benchmarks/host_overhead.py --streams 0 100 500 [--num-seqs 256] [--steps 50] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from environment import announce  # noqa: E402
from synthetic_tokenizer import write_synthetic_tokenizer  # noqa: E402
from throughput import all_decoding, step_until_decoding  # noqa: E402

from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.engine.async_engine import AsyncEngine  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.serving.deltas import stream_deltas  # noqa: E402


def tiny_model_config(vocab: int = 49152) -> str:
    """A 2-layer, 64-wide random Llama with SmolLM2's 49k vocabulary (or `vocab`) and a synthetic tokenizer of
    that size, so that it runs anywhere (no model package, no download) and detokenizes like a served model."""
    d = Path(tempfile.mkdtemp(prefix="host-overhead-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    eos = write_synthetic_tokenizer(d, vocab)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, rope_theta=100000.0, rms_norm_eps=1e-5, hidden_act="silu",
                  tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos)
    (d / "config.json").write_text(json.dumps(config))
    return f"random:{d / 'config.json'}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(100, 1024))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--penalties", action="store_true",
                   help="every request with repetition, frequency and presence penalties")
    p.add_argument("--final-only", action="store_true",
                   help="requests as the offline LLM makes them: no output is built for one before it finishes")
    p.add_argument("--streams", type=float, nargs="+", metavar="MS",
                   help="time the served step loop instead, at each of these stream intervals (ms)")
    args = p.parse_args()
    announce()
    if args.streams and args.final_only:
        p.error("--final-only: streams read every output; it applies only without --streams")
    torch.set_num_threads(1)  # the phases are single-threaded Python; keep the model's share small and stable
    model = tiny_model_config()
    if args.streams:
        print(f"{args.num_seqs} streams decoding, mean of {args.steps} steps:")
        for _ in range(args.rounds):
            for interval in args.streams:
                loop_cpu, whole, sent = asyncio.run(served_steps(model, args, interval))
                print(f"  stream_interval_ms={interval:<6g} event loop CPU {loop_cpu:6.2f} ms/step   whole step "
                      f"{whole:6.2f} ms   outputs sent {sent:5.1f}/step")
        return

    engine = decoding_engine(model, args, async_scheduling=False)  # the phases one after another
    runner = engine.executor.worker.runner
    times: dict[str, list[float]] = {"schedule": [], "prepare": [], "execute": [], "process": []}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = engine.scheduler.schedule()
        t1 = time.perf_counter()
        runner.prepare(batch)
        t2 = time.perf_counter()
        output = engine.executor.collect(engine.executor.launch(batch))
        t3 = time.perf_counter()
        engine._process(batch, output)
        t4 = time.perf_counter()
        assert batch.num_rows == args.num_seqs and batch.num_tokens == args.num_seqs, (batch.num_rows, batch.num_tokens)
        for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[name].append(dt * 1e3)

    print(f"{args.num_seqs} decoding sequences, median of {args.steps} steps (ms):")
    for name, values in times.items():
        print(f"  {name:9s} {statistics.median(values):7.2f}")
    host = sum(statistics.median(times[k]) for k in ("schedule", "prepare", "process"))
    print(f"  host work outside the model (schedule + prepare + process): {host:.2f} ms/step")
    engine.shutdown()

    print(f"whole steps, median of {args.steps} (ms):")
    for _ in range(args.rounds):
        for async_scheduling in (False, True):
            engine = decoding_engine(model, args, async_scheduling)
            step_times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                engine.step()
                step_times.append((time.perf_counter() - t0) * 1e3)
            print(f"  async_scheduling={async_scheduling!s:5s} {statistics.median(step_times):7.2f}")
            engine.shutdown()


async def served_steps(model: str, args: argparse.Namespace, interval_ms: float) -> tuple[float, float, float]:
    """The served step loop once every stream decodes: the event loop's CPU ms per step (the engine's host
    work, the streams' output and delta cutting, the metrics), whole-step ms, outputs sent per step."""
    try:
        from pagedserve.serving.metrics import ServerMetrics
        metrics = ServerMetrics("host-overhead")
    except ImportError:  # no Ray: the step loop without metrics
        metrics = None
    core = AsyncEngine(EngineConfig(model=model, max_num_seqs=args.num_seqs, max_num_batched_tokens=8192,
                                    kv_cache_memory="2GiB"), metrics=metrics, stream_interval_ms=interval_ms)
    params = decode_params(args)
    sent = 0

    async def read(prompt: list[int]) -> None:
        nonlocal sent
        async for _ in stream_deltas(core.generate(prompt, params), params):
            sent += 1

    readers = [asyncio.create_task(read(prompt)) for prompt in random_prompts(args)]
    engine = core.llm_engine
    marks: list[tuple[float, float, int]] = []  # at each step's start: wall time, this thread's CPU time, sent
    advance = engine.advance_async

    async def timed_advance():
        if all_decoding(engine):
            marks.append((time.perf_counter(), time.thread_time(), sent))
        return await advance()

    engine.advance_async = timed_advance
    while len(marks) <= args.steps + 5:
        await asyncio.sleep(0.05)
        failed = next((r for r in readers if r.done() and r.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
    for reader in readers:
        reader.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    core.shutdown()
    (w0, c0, s0), (w1, c1, s1) = marks[5], marks[5 + args.steps]  # past the first decode steps' sends
    return (c1 - c0) * 1e3 / args.steps, (w1 - w0) * 1e3 / args.steps, (s1 - s0) / args.steps


def decoding_engine(model: str, args: argparse.Namespace, async_scheduling: bool) -> LLMEngine:
    """An engine whose `num_seqs` sequences have all been prefilled and decode from here on."""
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=args.num_seqs, max_num_batched_tokens=8192,
                                    kv_cache_memory="2GiB", async_scheduling=async_scheduling))
    params = decode_params(args)
    for prompt in random_prompts(args):
        request = engine.inputs.make_request(prompt, params)
        request.final_output_only = args.final_only
        engine.enqueue(request)
    step_until_decoding(engine)
    return engine


def random_prompts(args: argparse.Namespace) -> list[list[int]]:
    """`num_seqs` prompts of random ids, their lengths drawn from `prompt_len`, the same for every run."""
    rng = random.Random(args.seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(*args.prompt_len))] for _ in range(args.num_seqs)]


def decode_params(args: argparse.Namespace) -> SamplingParams:
    """Greedy, long enough for every timed step, with the penalties when `--penalties` asks for them."""
    penalties = dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5) if args.penalties else {}
    return SamplingParams(temperature=0.0, max_tokens=args.steps + 200, ignore_eos=True, **penalties)


if __name__ == "__main__":
    main()
