"""The Serve application on a GPU, as users run it: `serve run deploy/gpu.yaml` (a Qwen3-0.6B-shaped model with
random bf16 weights and a synthetic tokenizer, written first where that file expects it), checked over both of its
routes, then loaded with concurrent streams, beside the same engine offline on a Ray worker actor in the same run.

  python benchmarks/gpu_serve.py [--streams 64 256] [--output-tokens 256] [--json out.json]

1. The worker actor is placed with a GPU: `nvidia-smi` lists its process (ray::WorkerActor) and no other.
2. One greedy completion over the OpenAI route (HTTP) and the same over gRPC (the SDK): the same tokens.
3. For each stream count S: 2 x S streamed completions, S at a time (prompts of 100-1024 tokens, --output-tokens
   out, ignore_eos), output tokens/s and TTFT p50 at the client.
4. After Serve stops: the same requests through `LLM(executor="ray")` with max_num_seqs=S, the engine and worker
   actor without Serve: what Serve costs is the ratio, and its greedy tokens for the check prompt must be equal.

`serve run` runs with this interpreter's `ray.serve.scripts` (installed or from an offline bundle's PYTHONPATH).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from environment import announce  # noqa: E402

CONFIG = ROOT / "deploy" / "gpu.yaml"
HTTP = "http://127.0.0.1:8000"
GRPC = "127.0.0.1:9000"
CHECK_PROMPT = "The quick brown fox jumps over the lazy dog and"
READY_TIMEOUT_S = 600


def app_args(config: Path) -> dict:
    import yaml

    return yaml.safe_load(config.read_text())["applications"][0]["args"]


def write_model(config_json: Path, preset: str) -> None:
    """The random model deploy/gpu.yaml names: `preset`'s config (benchmarks/throughput.py) and a synthetic
    tokenizer of its vocabulary, so text prompts and streamed text cost what a real model's do."""
    from synthetic_tokenizer import write_synthetic_tokenizer
    from throughput import preset_config

    config = preset_config(preset)
    config_json.parent.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(config_json))
    write_synthetic_tokenizer(config_json.parent, config.vocab_size)


def start_serve(config: Path, log: Path) -> subprocess.Popen:
    """`serve run CONFIG` in its own process group (so that stopping it stops what it started)."""
    cli = "import sys; from ray.serve.scripts import cli; sys.exit(cli.main(prog_name='serve'))"
    out = log.open("w")
    return subprocess.Popen([sys.executable, "-c", cli, "run", str(config)], stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=ROOT)


def stop_serve(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a user stops `serve run` (it shuts Serve and its local cluster down), then the group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_ready(proc: subprocess.Popen, log: Path) -> float:
    """Seconds until the OpenAI route lists the model; fails with the log's end if `serve run` exits first."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < READY_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited ({proc.returncode}); its log ends:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{HTTP}/v1/models", timeout=5) as r:
                if json.load(r)["data"]:
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"not ready in {READY_TIMEOUT_S} s; the log ends:\n{log.read_text()[-3000:]}")


def post(path: str, body: dict) -> dict:
    request = urllib.request.Request(f"{HTTP}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.load(r)


def check_routes(model_id: str, max_tokens: int) -> dict:
    """One greedy completion over HTTP and over gRPC: both texts, and the gRPC route's tokens."""
    from pagedserve.client import Client

    body = dict(model=model_id, prompt=CHECK_PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    http = post("/v1/completions", body)["choices"][0]
    with Client(GRPC, application="pagedserve") as client:
        grpc_out = client.generate(CHECK_PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return {"http_text": http["text"], "grpc_text": grpc_out.text, "grpc_tokens": list(grpc_out.token_ids)}


def gpu_processes() -> list[str]:
    """The processes holding GPU memory (nvidia-smi), each with its title: Ray names its actors' processes
    (ray::WorkerActor), so this shows which of them the GPU went to."""
    import psutil

    if not shutil.which("nvidia-smi"):
        return ["no nvidia-smi: no GPU here"]
    smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                         capture_output=True, text=True)
    lines = []
    for row in smi.stdout.strip().splitlines():
        pid, memory = (x.strip() for x in row.split(","))
        try:
            title = " ".join(psutil.Process(int(pid)).cmdline())[:80]
        except (psutil.Error, ValueError):
            title = "?"
        lines.append(f"pid {pid} ({title}): {memory}")
    return lines


def workload(n: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of 100-1024 tokens, as throughput.py draws them."""
    from throughput import make_workload

    return make_workload(n, (100, 1024), (1, 1), vocab, seed)[0]


def offline(model: str, settings: dict, streams: int, prompts: list[list[int]], output_tokens: int,
            check_tokens: int) -> dict:
    """The same engine on a Ray worker actor without Serve: tokens/s over `prompts`, `streams` at a time, and
    its greedy tokens for the check prompt."""
    from pagedserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, executor="ray", **dict(settings, max_num_seqs=streams))
    print(f"  offline engine for {streams} sequences loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        check = llm.generate([CHECK_PROMPT], SamplingParams(temperature=0, max_tokens=check_tokens,
                                                            ignore_eos=True))[0].outputs[0]
        params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
        llm.generate([p[::-1] for p in prompts[:4]], params)  # warm-up: the same lengths, other blocks
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens_per_s": produced / elapsed, "seconds": elapsed, "check_tokens": list(check.token_ids),
            "check_text": check.text}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--preset", default="qwen3-0.6b", help="the random model's shape (throughput.py's PRESETS)")
    p.add_argument("--config", type=Path, default=CONFIG, help="the Serve config to run (default deploy/gpu.yaml)")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/gpu_serve"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    env = announce()
    import ray
    from served_streams import run_streams

    settings = app_args(args.config)
    model = settings.pop("model")
    for key in ("max_waiting_requests", "stream_interval_ms", "num_replicas", "prefix_routing", "api_keys"):
        settings.pop(key, None)
    write_model(Path(model.removeprefix("random:")), args.preset)
    vocab = json.loads(Path(model.removeprefix("random:")).read_text())["vocab_size"]
    # the same requests served and offline: 2 x S prompts for S streams
    workloads = {streams: workload(2 * streams, vocab, seed=streams) for streams in args.streams}
    args.log_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"environment": env, "config": str(args.config), "served": [], "offline": []}
    proc = start_serve(args.config, args.log_dir / "serve_run.log")
    try:
        result["ready_s"] = wait_ready(proc, args.log_dir / "serve_run.log")
        with urllib.request.urlopen(f"{HTTP}/v1/models", timeout=5) as r:
            model_id = json.load(r)["data"][0]["id"]
        print(f"serve run {args.config.name}: ready in {result['ready_s']:.0f} s, model {model_id}", flush=True)
        result["placement"] = gpu_processes()
        print("\n".join(f"  {line}" for line in result["placement"]), flush=True)
        routes = check_routes(model_id, args.check_tokens)
        result["routes"] = routes
        same = routes["http_text"] == routes["grpc_text"]
        print(f"greedy over HTTP and gRPC: {'the same text' if same else 'DIFFERENT'}: {routes['grpc_text']!r}",
              flush=True)
        for streams, prompts in workloads.items():
            run_args = argparse.Namespace(streams=streams, output_tokens=args.output_tokens)
            r = asyncio.run(run_streams(model_id, prompts, run_args))
            result["served"].append({"streams": streams, **r})
            print(f"served, {streams} streams: {r['tokens_per_s']:,.0f} output tokens/s, TTFT p50 "
                  f"{r['ttft_p50'] * 1e3:.0f} ms, {r['messages']} messages", flush=True)
    finally:
        stop_serve(proc)
    ray.init(include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    try:
        for streams, prompts in workloads.items():
            r = offline(model, settings, streams, prompts, args.output_tokens, args.check_tokens)
            result["offline"].append({"streams": streams, **r})
            print(f"offline LLM(executor='ray'), max_num_seqs={streams}: {r['tokens_per_s']:,.0f} output tokens/s",
                  flush=True)
    finally:
        ray.shutdown()
    served_tokens = result["routes"]["grpc_tokens"]
    equal = all(o["check_tokens"] == served_tokens for o in result["offline"])
    print("\n| streams | served tokens/s | offline tokens/s | served / offline | TTFT p50 ms |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for s, o in zip(result["served"], result["offline"], strict=True):
        print(f"| {s['streams']} | {s['tokens_per_s']:,.0f} | {o['tokens_per_s']:,.0f} | "
              f"{s['tokens_per_s'] / o['tokens_per_s']:.2f} | {s['ttft_p50'] * 1e3:.0f} |")
    print(f"GPU_SERVE: served greedy tokens {'equal' if equal else 'NOT equal'} to offline; HTTP and gRPC "
          f"{'equal' if result['routes']['http_text'] == result['routes']['grpc_text'] else 'NOT equal'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str))
    if not equal or result["routes"]["http_text"] != result["routes"]["grpc_text"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
