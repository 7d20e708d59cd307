"""What a worker costs to start: the CPU seconds of a fresh process's imports and of building its model and KV pool
(`Worker`), and, over Ray, the time until a tensor-parallel engine's worker actors are ready and the CPU each spent.

Every Ray worker actor is a fresh process, as is every Serve replica: what one pays at start it pays again each time
an engine starts, a replica restarts or Serve scales out (and each test of a cluster does).

  scripts/loopback-netns.sh .venv/bin/python benchmarks/worker_start.py [--model PATH] [--repeats 5] [--tp 2]

The model: PATH (a checkpoint directory, or "embedded" for the embedded SmolLM2's GGUF), by default a 2-layer,
64-wide random Qwen2 made here, on which the fixed costs are all there is. Each figure is the median of --repeats
fresh processes (engines, over Ray).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from environment import announce  # noqa: E402

MAX_MODEL_LEN = 256
# A fresh process's phases, each timed in CPU seconds (the process's own, all its threads)
PHASES = """
import json, sys, time
phases, last = {}, time.process_time()
def mark(name):
    global last
    now = time.process_time()
    phases[name], last = now - last, now
import torch
mark("import torch")
from pagedserve.workers.worker import Worker
mark("import the worker")
from pagedserve.config import EngineConfig
from pagedserve.workers.loader import resolve_model
from pagedserve.workers.models.model_config import ModelConfig
source = resolve_model(sys.argv[1] or None)
config = ModelConfig.from_file(source.config_path)
worker = Worker(EngineConfig(max_model_len=int(sys.argv[2])), source, config, int(sys.argv[2]))
mark("Worker(): the model")
worker.init_kv_pool(worker.available_blocks, worker.available_offload_blocks)
mark("the KV pool")
print(json.dumps(phases))
"""


def tiny_model(directory: Path) -> str:
    import torch
    import transformers

    config = transformers.Qwen2Config(vocab_size=1001, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return str(directory)


def process_phases(model: str, repeats: int) -> dict[str, float]:
    """The median CPU seconds of each phase over `repeats` fresh processes."""
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", PHASES, model, str(MAX_MODEL_LEN)], capture_output=True,
                             text=True, check=True, env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
        runs.append(json.loads(out.stdout.splitlines()[-1]))
    return {phase: statistics.median(run[phase] for run in runs) for phase in runs[0]}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def ray_engines(model: str, repeats: int, tp: int) -> dict[str, float]:
    """Over Ray: the median seconds from `LLM(...)` to ready, and of each worker actor's CPU seconds at ready."""
    import ray

    from pagedserve import LLM

    ray.init(num_cpus=2 * tp, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    walls, cpus = [], []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            with LLM(model or None, tensor_parallel_size=tp, executor="ray", max_model_len=MAX_MODEL_LEN) as llm:
                walls.append(time.perf_counter() - start)
                cpus += [_cpu_seconds(pid) for pid in llm.llm_engine.executor.worker_pids()]
    finally:
        ray.shutdown()
    return {"to ready (s, wall)": statistics.median(walls), "a worker actor at ready (CPU s)": statistics.median(cpus)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help='a checkpoint directory, or "embedded"')
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tp", type=int, default=2, help="ranks of the engines started over Ray (0: none)")
    args = parser.parse_args()
    announce()
    with tempfile.TemporaryDirectory() as tmp:
        model = "" if args.model == "embedded" else args.model or tiny_model(Path(tmp))
        rows = {f"fresh process: {k} (CPU s)": v for k, v in process_phases(model, args.repeats).items()}
        if args.tp:
            rows |= {f"tp={args.tp} over Ray: {k}": v for k, v in ray_engines(model, args.repeats, args.tp).items()}
    for name, value in rows.items():
        print(f"{value:8.2f}  {name}")


if __name__ == "__main__":
    main()
