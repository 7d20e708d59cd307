"""The benchmark scripts' own parts that decide what a GPU run measures, checked where no GPU is."""

from __future__ import annotations

import random

import pytest

from benchmarks.synthetic_tokenizer import EOS, write_synthetic_tokenizer
from pagedserve.engine.detokenizer import Detokenizer


def test_synthetic_tokenizer_has_the_vocabulary_asked_for(tmp_path):
    from transformers import AutoTokenizer

    eos = write_synthetic_tokenizer(tmp_path, 5000, seed=3)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 5000 and eos == 4999 and tok.eos_token_id == eos and tok.convert_ids_to_tokens(eos) == EOS
    text = "the quick brown fox, 42 times"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode(text)
    assert len(ids) < len(text)  # merges apply: words are not spelled out byte by byte
    # Random ids, as a random-weight model draws them, decode to text a piece at a time.
    rng = random.Random(0)
    drawn = [rng.randrange(256, 4999) for _ in range(200)]
    detok = Detokenizer(tok)
    assert tok.clean_up_tokenization_spaces is False  # the Rust decoder's fast path, as for Llama-3 and Qwen2
    for i in range(len(drawn)):
        detok.update(0, drawn[: i + 1], 0, skip_special_tokens=True, stop=[])
    assert detok.text(0) == tok.decode(drawn) and len(detok.text(0)) > 400


def test_decode_profile_runs_the_steps_as_generate_does_and_leaves_nothing_behind(tiny_random):
    """The throughput script's profile of decode steps (what a GPU run reports on the host side): it times
    and profiles steps of final-output-only requests, and leaves the engine with no request and no block."""
    from benchmarks.throughput import profile_decode
    from pagedserve import LLM

    with LLM(tiny_random, max_model_len=256, max_num_seqs=4, kv_cache_memory="8MiB") as llm:
        rng = random.Random(5)
        prompts = [[rng.randrange(100, 4000) for _ in range(n)] for n in (9, 30, 17)]
        timeline = profile_decode(llm, prompts, [4, 4, 4], steps=3)
        assert timeline["steps"] == 3 and timeline["rows"] == 3 and timeline["step_us_unprofiled"] > 0
        assert sorted(timeline["host_phases_us"]) == ["phase collect", "phase launch", "phase process",
                                                      "phase schedule"]
        assert all(us > 0 for us in timeline["host_phases_us"].values()) and timeline["host_ops"]
        assert "busy_us" not in timeline  # no device timeline off CUDA
        engine = llm.llm_engine
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_environment_describes_this_checkout_and_machine():
    """What every benchmark prints first and keeps in its JSON: the real commit, cores, CPU, versions."""
    import importlib.metadata
    import json
    import os
    import platform
    import subprocess
    from pathlib import Path

    from benchmarks.environment import ISA_FLAGS, as_text, describe

    root = Path(__file__).resolve().parent.parent
    env = describe()
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, check=True).stdout
    assert env["commit"] == head and env["dirty"] == bool(status.strip())
    assert env["cores"] == os.cpu_count()
    first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first_cpu.splitlines())}
    flags = set(fields["flags"].split())
    assert env["cpu"] == fields["model name"]
    assert env["isa"] == [f for f in ISA_FLAGS if f in flags]
    assert env["virtual_machine"] == ("hypervisor" in flags)
    import torch

    if torch.cuda.is_available():
        assert env["gpu"].startswith(torch.cuda.get_device_name(0))
    else:
        assert env["gpu"] is None
    assert env["versions"]["python"] == platform.python_version()
    for name in ("torch", "transformers", "ray", "xgrammar"):  # the dev install's
        assert env["versions"][name] == importlib.metadata.version(name)
    assert json.loads(json.dumps(env)) == env  # as it goes into a benchmark's --json
    text = as_text(env)
    assert head[:12] in text and f"{os.cpu_count()} logical cores" in text and env["cpu"] in text


def test_system_info_names_the_cpu_features_a_llama_cpp_build_uses():
    """Which ggml CPU features a llama-server build runs with, from its log: what tells the builds apart."""
    from benchmarks.peers import system_info_features

    log = ("0.00.003 I srv  llama_server: initializing ...\n0.00.005 I cmn  common_param: system_info: n_threads = 2 "
           "(n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | "
           "AVX512 = 0 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | \n0.00.008 E srv    load_model: "
           "failed to load model\n")
    assert system_info_features(log) == "SSE3 SSSE3 AVX AVX2 F16C FMA AMX_INT8 LLAMAFILE OPENMP REPACK"
    assert system_info_features("no such line") is None


def test_nano_vllm_workload_draws_as_its_bench_script_does():
    """nano-vllm's bench.py seeds Python's module-level generator and draws every prompt, then every max_tokens:
    the same draws here give the very requests its published figures were measured on."""
    from benchmarks.throughput import nano_vllm_workload

    random.seed(0)
    expected_prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    expected_outputs = [random.randint(100, 1024) for _ in range(256)]
    random.seed()
    prompts, outputs = nano_vllm_workload()
    assert prompts == expected_prompts and outputs == expected_outputs
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in outputs)


@pytest.mark.slow
@pytest.mark.standalone
def test_gpu_serve_runs_the_serve_config_and_compares_it_with_offline(tmp_path):
    """benchmarks/gpu_serve.py end to end on the CPU, so that a GPU run spends its time measuring: `serve run` of
    deploy/gpu.yaml with the model, device and sizes swapped for a tiny CPU model, both routes answering the same
    greedy tokens as the offline engine, streams counted whole."""
    import json
    import subprocess
    import sys

    import yaml

    config = yaml.safe_load(open("deploy/gpu.yaml"))
    args = config["applications"][0]["args"]
    args.update(model=f"random:{tmp_path / 'model' / 'config.json'}", device="cpu", dtype="float32",
                max_num_seqs=4, max_model_len=2048, kv_cache_memory="64MiB")
    for key in ("gpu_memory_utilization", "cuda_graphs", "async_scheduling"):
        args.pop(key)
    config["applications"][0]["deployments"][0]["num_replicas"] = 1
    (tmp_path / "cpu.yaml").write_text(yaml.safe_dump(config))
    out = subprocess.run([sys.executable, "benchmarks/gpu_serve.py", "--config", str(tmp_path / "cpu.yaml"),
                          "--preset", "qwen2-tiny", "--streams", "4", "--output-tokens", "8", "--check-tokens",
                          "6", "--log-dir", str(tmp_path / "logs"), "--json", str(tmp_path / "out.json")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert [s["streams"] for s in result["served"]] == [4] == [o["streams"] for o in result["offline"]]
    assert all(s["tokens"] == 2 * s["streams"] * 8 for s in result["served"])
    assert result["routes"]["http_text"] == result["routes"]["grpc_text"] != ""
    assert all(o["check_tokens"] == result["routes"]["grpc_tokens"] for o in result["offline"])


def test_gpu_tp_shared_compares_two_ranks_with_one():
    """benchmarks/gpu_tp_shared.py on the CPU (TP 2 over gloo against TP 1), so that a GPU run spends its time
    comparing: both give the same fp32 tokens, and the last line says so."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "benchmarks/gpu_tp_shared.py", "--device", "cpu", "--preset",
                          "qwen2-tiny", "--dtypes", "float32", "--num-prompts", "3", "--max-tokens", "6"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "float32: TP 2 on one cpu (CPU slots) vs TP 1: 3/3 prompts equal" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("TP_SHARED: ok; float32 3/3 equal")


def test_a_layer_draft_holds_the_models_first_layers_and_drafts_losslessly(embedded_dir, tmp_path):
    """The speculative benchmark's draft: the embedded model's first layers with their GGUF blocks, final norm and
    output layer, which the engine loads as a draft model; greedy tokens as without speculation."""
    from safetensors import safe_open

    from benchmarks.speculative import layer_draft
    from pagedserve import LLM, SamplingParams
    from tests.test_speculative_engine import speculating

    draft = layer_draft(embedded_dir, 2, tmp_path / "draft")
    with safe_open(draft / "gguf_blocks.safetensors", "pt") as f:
        names, types = list(f.keys()), f.metadata()
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {"0", "1"}
    assert set(names) <= set(types)  # each block tensor's GGUF type
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = "The capital of France is"
    with LLM() as llm:
        expected = llm.generate([prompt], params)[0].outputs[0].token_ids
    with speculating(LLM(speculative_config={"method": "draft_model", "model": str(draft),
                                             "num_speculative_tokens": 3})) as llm:
        out = llm.generate([prompt], params)[0].outputs[0].token_ids
        stats = llm.stats()
    assert out == expected and stats["spec_num_accepted_tokens"] > 0
