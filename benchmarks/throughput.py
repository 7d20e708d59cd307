"""Offline throughput: pagedserve vs Hugging Face transformers (and llama.cpp's llama-server on a GGUF) on the
same model, same machine, one run.

N requests with seeded random prompt and output lengths, ignore_eos, greedy (or, with --temperature and
--top-p, sampled the same way by every engine: no top-k or min-p of their own). Output tokens/s counts
the requested output tokens only (padding and tokens HF generates past a request's length do not count).
llama-server gets all N requests at once over HTTP with N slots (`-np N`, continuous batching), from each of
setup_peers.sh's two llama.cpp builds: the portable AVX2 one and the one built for this CPU (-DGGML_NATIVE=ON,
its AMX kernels left out), as pagedserve's kernels are (`--llama-server portable` or `native` for one of them).

  python benchmarks/throughput.py                                   # embedded SmolLM2, CPU
  python benchmarks/throughput.py --num-requests 16 --prompt-len 64 512 --output-len 128 128 \
      --hf-batch-size 16 --llama-server                             # CPU, beside llama.cpp (setup_peers.sh)
  python benchmarks/throughput.py --gguf-type BF16 --llama-server   # the same model with bf16 weights, as
                                                                    # published checkpoints are (Q4_K_M: as
                                                                    # llama-quantize makes GGUFs from them)
  python benchmarks/throughput.py --random qwen2.5-0.5b --dtype bfloat16 --num-requests 256 \
      --prompt-len 100 1024 --output-len 256 256 --hf-batch-size 64 --hf-generate-batch --cuda-graphs  # GPU
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from environment import announce  # noqa: E402

PRESETS = {
    "qwen2.5-0.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936,
                         hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu"),
    "qwen3-0.6b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
                       hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu"),
    "qwen2-tiny": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=2048,  # CPU smoke runs
                       hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=2048, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu"),
    "llama-3.1-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                         hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
                         rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu"),
    "llama-3-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                       hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu"),
}


def make_random_checkpoint(preset: str, dtype: torch.dtype, device: str) -> Path:
    """Random weights saved as a checkpoint, so both engines load the very same model; removed at exit
    (an 8B checkpoint is 16 GB of disk). A synthetic tokenizer of the model's vocabulary comes with it, so
    that pagedserve detokenizes its outputs as it does serving a real model."""
    from synthetic_tokenizer import write_synthetic_tokenizer
    from transformers import AutoModelForCausalLM

    d = Path(tempfile.mkdtemp(prefix=f"bench-{preset}-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    config = preset_config(preset)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(d)
    write_synthetic_tokenizer(d, config.vocab_size)
    return d


def preset_config(preset: str):
    """A transformers config of `preset`'s shape."""
    from transformers import AutoConfig

    cfg = dict(PRESETS[preset])
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def retyped_gguf(src: Path, qtype: str) -> Path:
    """A copy of GGUF `src` whose 2-D weights are `qtype` ("BF16", "F16"): their dequantized values rounded to
    it, as a checkpoint published in that type holds them; every other tensor and field as it is. Every engine
    then runs the same 16-bit weights (pagedserve and llama.cpp from the GGUF, transformers from its
    conversion). Removed at exit."""
    import gguf
    from gguf.quants import dequantize, quantize

    target = gguf.GGMLQuantizationType[qtype]

    def retype(tensor):
        if tensor.data.ndim != 2 or tensor.tensor_type == target:
            return None
        return quantize(dequantize(tensor.data, tensor.tensor_type), target), target

    d = Path(tempfile.mkdtemp(prefix="bench-gguf-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return rewritten_gguf(src, d / f"{src.stem.rsplit('.', 1)[0]}.{qtype}.gguf", retype)


def quantized_gguf(src: Path, ftype: str) -> Path:
    """GGUF `src` quantized to `ftype` (Q4_K_M, Q5_K_M, ...) by llama.cpp's llama-quantize, as such files are
    made (its own choice of type per tensor, Q5_0 / Q8_0 where a row is no multiple of 256). Beside `src`,
    removed with it."""
    import subprocess

    from peers import peer_binary

    out = src.with_name(f"{src.stem.rsplit('.', 1)[0]}.{ftype}.gguf")
    subprocess.run([str(peer_binary("llama-quantize")), str(src), str(out), ftype], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def gguf_writer_like(reader, out: Path, fields: dict | None = None):
    """A GGUFWriter to `out` holding every field of the file `reader` reads (the values in `fields` instead of
    theirs), ready for its tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(out), arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        writer.add_key_value(field.name, (fields or {}).get(field.name, field.contents()), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    return writer


def rewritten_gguf(src: Path, out: Path, retype, added: dict | None = None) -> Path:
    """GGUF `src` written to `out` with every field as it is and each tensor as `retype(tensor)` gives it (its
    data and GGML type), or as it is where that is None; then the tensors `added` (name: (data, GGML type))."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf_writer_like(reader, out)
    for tensor in reader.tensors:
        data, kind = retype(tensor) or (tensor.data, tensor.tensor_type)
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    for name, (data, kind) in (added or {}).items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def make_workload(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(n):
        prompts.append([rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_len))])
        outputs.append(rng.randint(*output_len))
    return prompts, outputs


def nano_vllm_workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024):
    """nano-vllm's bench.py, draw for draw: `random.seed(0)`, then every prompt (randint(100, max_input_len)
    tokens, each randint(0, 10000)), then every request's max_tokens (randint(100, max_output_len)). It samples
    at temperature 0.6 with ignore_eos and counts the requested output tokens."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))] for _ in range(num_seqs)]
    outputs = [rng.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, outputs


@contextlib.contextmanager
def triton_compilations():
    """The Triton kernels compiled (or read from Triton's disk cache) inside the block, by name. A timed run
    should see none: a variant first needed mid-run costs about a second of it."""
    names: list[str] = []
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one without hooks: nothing to count
        yield names
        return
    before = knobs.runtime.jit_cache_hook

    def hook(**kwargs) -> bool:
        names.append(str(kwargs.get("repr", "?")).split("[", 1)[0])
        return False  # compile as usual

    knobs.runtime.jit_cache_hook = hook
    try:
        yield names
    finally:
        knobs.runtime.jit_cache_hook = before


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes the model's weights take as the engine holds them: parameters, buffers, and the CPU kernels'
    panels or packed weights (each tensor once)."""
    tensors = {}
    for module in model.modules():
        held = [*module.parameters(recurse=False), *module.buffers(recurse=False),
                getattr(module, "panels", None), getattr(module, "packed", None)]
        tensors.update((id(t), t.numel() * t.element_size()) for t in held if isinstance(t, torch.Tensor))
    return sum(tensors.values())


def warmup_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """The first two prompts reversed: their lengths, none of their blocks (the first ones differ)."""
    return [p[::-1] for p in prompts[:2]]


def bench_pagedserve(model_dir: Path, prompts, outputs, args, cuda_graphs: bool = False,
                     gguf_linears: bool = True, async_scheduling: bool = True) -> dict:
    from pagedserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(model_dir), dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len,
              cuda_graphs=cuda_graphs, gguf_linears=gguf_linears, async_scheduling=async_scheduling)
    load = time.perf_counter() - t0
    print(f"  loaded in {load:.1f} s", flush=True)  # each phase as it ends: a run cut short still says where it was
    # Warm up on prompts of the same lengths that share no block with the timed ones: the timed prompts
    # themselves would sit in the prefix cache, and their prefill would be skipped.
    t0 = time.perf_counter()
    llm.generate(warmup_prompts(prompts), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    print(f"  warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=n, ignore_eos=True)
              for n in outputs]
    sync(args.device)
    with triton_compilations() as compiled:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync(args.device)
        elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs), "every request must produce exactly max_tokens tokens"
    stats = llm.stats()
    weights = weight_bytes(llm.llm_engine.executor.worker.model)
    timeline = profile_decode(llm, prompts, outputs, args.profile_steps) if args.profile_steps else None
    llm.shutdown()
    del llm
    name = "pagedserve" + (" (decode CUDA graphs)" if cuda_graphs else "") + (
        "" if gguf_linears else " (gguf_linears=False: fp32 linear layers)") + (
        "" if async_scheduling else " (async_scheduling=False)")
    note = (f"weights {weights / 2**20:,.0f} MiB, {stats['num_total_blocks']} KV blocks, "
            f"{stats['num_preemptions']} preemptions")
    if args.device.startswith("cuda"):
        note += f", {len(compiled)} Triton compilations while timed" + (f" ({', '.join(compiled)})" if compiled else "")
    if timeline:
        note += (f"; {timeline['steps']} decode steps of {timeline['rows']} rows: "
                 f"{timeline['step_us_unprofiled']} µs a step unprofiled")
    if timeline and "busy_us" in timeline:
        note += (f" for {timeline['device_us_per_step']} µs of device work "
                 f"({timeline['busy_fraction_unprofiled']:.0%} busy; {timeline['busy_fraction']:.0%} profiled, "
                 f"largest idle gaps {timeline['largest_gaps_us']} µs)")
    print(f"{name}: {produced / elapsed:,.1f} output tokens/s ({elapsed:.1f} s; load {load:.1f} s); {note}",
          flush=True)  # now, so that a later failure of the run does not lose it
    if timeline:
        print(f"  host time per decode step, by phase: {timeline['host_phases_us']} µs", flush=True)
    for kind in ("host_ops", "device_ops") if timeline else ():
        if kind not in timeline:
            continue
        print(f"  {kind} per decode step:", "; ".join(f"{op['name']} x{op['calls_per_step']} {op['us_per_step']} µs"
                                                   for op in timeline[kind]), flush=True)
    return {"name": name, "seconds": elapsed, "tokens": produced, "load_s": load, "note": note,
            "timeline": timeline}


def device_timeline(kernels: list[tuple[float, float]], span: tuple[float, float]) -> dict:
    """How busy a device was over `span`: its kernels' (start, end) in µs, overlaps merged. The busy
    fraction, and the largest idle gaps between kernels (where the device waited for the host)."""
    merged: list[list[float]] = []
    for start, end in sorted(kernels):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    busy = sum(end - start for start, end in merged)
    gaps = sorted((b[0] - a[1] for a, b in itertools.pairwise(merged)), reverse=True)
    return {"busy_fraction": busy / max(span[1] - span[0], 1e-9), "largest_gaps_us": [round(g) for g in gaps[:5]],
            "kernels": len(kernels), "span_us": round(span[1] - span[0]), "busy_us": round(busy)}


def all_decoding(engine) -> bool:
    """Whether every request of an `LLMEngine` is prefilled: from then on each step decodes one token a row."""
    return not (engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_tokens_with_pending - 1 for s in engine.scheduler.running))


def step_until_decoding(engine) -> None:
    """Step an `LLMEngine` until every request is prefilled (`all_decoding`)."""
    while not all_decoding(engine):
        engine.step()


def profile_decode(llm, prompts, outputs, steps: int) -> dict:
    """Profile `steps` engine steps once every request decodes, run as `LLM.generate` runs them: the host
    time of the step's phases (scheduling, launching, waiting for the draws, processing them) and its largest
    ops, and the step's time unprofiled (the profiler adds host time to every op it records). On CUDA also
    the device's work per step, its busy fraction (profiled and unprofiled), its largest idle gaps and ops.
    The requests are aborted after."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pagedserve import SamplingParams

    engine = llm.llm_engine
    device = engine.executor.device_type
    on_cuda = device == "cuda"
    ids = []
    for p, n in zip(prompts, outputs, strict=True):
        params = SamplingParams(temperature=0, max_tokens=n + 2 * steps + 64, ignore_eos=True)
        request = engine.inputs.make_request(p, params)
        request.final_output_only = True  # as `LLM.generate` runs the timed requests: no output built per step
        engine.enqueue(request)
        ids.append(request.request_id)
    step_until_decoding(engine)
    for _ in range(4):
        engine.step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    plain_step_us = (time.perf_counter() - start) / steps * 1e6
    phases = [(engine, "_schedule"), (engine.executor, "launch"), (engine.executor, "collect"),
              (engine, "_process")]
    for obj, name in phases:  # instance attributes over the methods, for this profile only
        setattr(obj, name, _labelled(getattr(obj, name), f"phase {name.lstrip('_')}"))
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            sync(device)
    finally:
        for obj, name in phases:
            delattr(obj, name)
    rows = len(engine.scheduler.running)
    for rid in ids:
        engine.abort_request(rid)
    engine.step()  # processes the step still in flight
    result = {"steps": steps, "rows": rows, "step_us_unprofiled": round(plain_step_us),
              "host_phases_us": {e.key: round(e.cpu_time_total / steps, 1) for e in prof.key_averages()
                                 if e.key.startswith("phase")},
              "host_ops": top_ops(prof, "self_cpu_time_total", steps)}
    if not on_cuda:
        return result
    events = prof.events()
    kernels = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
    host = [e for e in events if e.device_type == DeviceType.CPU]
    timeline = device_timeline(kernels, (min(e.time_range.start for e in host), max(e.time_range.end for e in host)))
    # The device's work per step against the step's time unprofiled: how busy it is when nothing watches.
    device_step_us = timeline["busy_us"] / steps
    return result | timeline | {"device_us_per_step": round(device_step_us),
                                "busy_fraction_unprofiled": device_step_us / plain_step_us,
                                "device_ops": top_ops(prof, "self_device_time_total", steps)}


def _labelled(fn, label: str):
    from torch.profiler import record_function

    def call(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return call


def top_ops(prof, key: str, steps: int, limit: int = 12) -> list[dict]:
    """The profile's `limit` largest ops by `key` (a FunctionEventAvg total, µs): where a step's host time or
    device time goes, per step."""
    ops = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:limit]
    return [{"name": e.key[:60], "calls_per_step": round(e.count / steps, 1),
             "us_per_step": round(getattr(e, key) / steps, 1)} for e in ops if getattr(e, key) > 0]


def bench_llama_server(gguf: Path, prompts, outputs, args, build: str = "portable") -> dict:
    """llama-server of llama.cpp `build` (peers.LLAMA_BUILDS) on all the requests at once. A server that dies
    (as a native build with ggml's AMX kernels did at load on an AMX-capable Xeon VM, and a native build on
    AMD EPYC machines) gives a result with its "error" in place of a figure."""
    from peers import LLAMA_BUILD_TITLES, llama_cpu_features, llama_server, timed_completions

    name = f"llama.cpp llama-server, {LLAMA_BUILD_TITLES[build]} (-np {len(prompts)}, {gguf.name})"
    slot = max(map(len, prompts)) + max(outputs) + 16
    log = Path(tempfile.mkdtemp(prefix="bench-llama-")) / "llama-server.log"
    atexit.register(shutil.rmtree, log.parent, ignore_errors=True)
    features = None
    try:
        features = llama_cpu_features(build)
        with llama_server(gguf, parallel=len(prompts), context_per_slot=slot, log_path=log, build=build) as url:
            replies, elapsed = timed_completions(url, prompts, outputs, {
                "temperature": args.temperature, "top_p": args.top_p, "top_k": 0, "min_p": 0.0})
            produced = sum(r["tokens_predicted"] for r in replies)
    except Exception as e:  # reported in place of its figure; the caller decides whether the run fails
        lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
        last = [line for line in lines if line.strip()][-1:]
        error = f"{type(e).__name__}: {e}" + (f"; its log ends: {last[0][:200]}" if last else "")
        print(f"{name}: failed: {error}", flush=True)
        return {"name": name, "build": build, "error": error, "cpu_features": features}
    assert produced == sum(outputs), f"llama-server produced {produced} tokens, not {sum(outputs)}"
    print(f"{name}: {produced / elapsed:,.1f} output tokens/s ({elapsed:.1f} s); ggml CPU features: {features}",
          flush=True)
    return {"name": name, "build": build, "seconds": elapsed, "tokens": produced, "cpu_features": features,
            "note": f"its own quantized kernels on the GGUF's weights; ggml CPU features {features}"}


def hf_sampling(args: argparse.Namespace) -> dict:
    """HF generation settings that sample as --temperature and --top-p ask (HF's own top-k of 50 off)."""
    if args.temperature == 0:
        return dict(do_sample=False)
    return dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0)


def bench_hf_generate(model_dir: Path, prompts, outputs, args, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    bs = args.hf_batch_size

    def run(batch_prompts, batch_outputs):
        longest = max(len(p) for p in batch_prompts)
        pad = 0
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p in batch_prompts], device=args.device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch_prompts], device=args.device)
        new = max(batch_outputs)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=pad, eos_token_id=None,
                           **hf_sampling(args))

    prompts, outputs = prompts[:args.hf_requests], outputs[:args.hf_requests]
    run(prompts[:2], [4, 4])  # warm-up
    sync(args.device)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), bs):
        run(prompts[i:i + bs], outputs[i:i + bs])
    sync(args.device)
    elapsed = time.perf_counter() - t0
    return {"name": f"HF generate (padded batches of {bs})", "seconds": elapsed, "tokens": sum(outputs),
            "note": hf_subset_note(len(prompts), args)}


def bench_hf_generate_batch(model_dir: Path, prompts, outputs, args, dtype: torch.dtype) -> dict:
    """HF's continuous batching, timed on its second call: the first sizes and fills its paged cache (and
    captures graphs) for this workload, which pagedserve's timing leaves out too (it starts beforehand)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model = model.to(args.device).eval()
    prompts, outputs = prompts[:args.hf_requests], outputs[:args.hf_requests]
    new = max(outputs)  # generate_batch takes one max_new_tokens for all requests
    config = GenerationConfig(max_new_tokens=new, eos_token_id=None, pad_token_id=0, **hf_sampling(args))
    times, tokens = [], 0
    with torch.no_grad():
        for _ in range(2):  # the manager persists from the first call to the second
            sync(args.device)
            t0 = time.perf_counter()
            results = model.generate_batch(inputs=prompts, generation_config=config, persistent_manager=True)
            sync(args.device)
            times.append(time.perf_counter() - t0)
            tokens = sum(len(r.generated_tokens) for r in results.values())
        model.destroy_cached_continuous_batching_manager()
    del model
    return {"name": "HF generate_batch (continuous batching)", "seconds": times[1], "tokens": tokens,
            "note": f"every request generates {new} tokens; its first call, with set-up, took {times[0]:.1f} s"
                    + (f"; {hf_subset_note(len(prompts), args)}" if args.hf_requests else "")}


def hf_subset_note(timed: int, args: argparse.Namespace) -> str:
    """What HF was timed on where --hf-requests cut the workload short (its figure is tokens/s all the same)."""
    return f"the first {timed} of the {args.num_requests} requests" if args.hf_requests else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--random", choices=sorted(PRESETS), help="random weights of this shape instead of --model")
    p.add_argument("--gguf-type", default=None,
                   help="the GGUF model (the embedded one or --model x.gguf) with its weights in this type instead: "
                        "BF16 or F16, or a type llama-quantize makes from the BF16 weights (Q4_K_M, Q5_K_M, ...)")
    p.add_argument("--workload", choices=["random", "nano-vllm"], default="random",
                   help="nano-vllm: its bench.py's requests exactly (256; prompts and outputs of 100-1024 tokens, "
                        "temperature 0.6); overrides --prompt-len, --output-len, --temperature and --top-p")
    p.add_argument("--num-requests", type=int, default=None, help="default 32; nano-vllm's workload: 256")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--hf-requests", type=int, default=None,
                   help="time HF on the first this many requests only (its tokens/s; a whole run takes long)")
    p.add_argument("--hf-generate-batch", action="store_true", help="also time HF generate_batch")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-pagedserve", action="store_true")
    p.add_argument("--llama-server", nargs="*", choices=["portable", "native"], default=None, metavar="BUILD",
                   help="also time llama.cpp's llama-server on the same GGUF (the embedded model or --model x.gguf): "
                        "its builds named (portable, native), both where none is named. A native build that "
                        "fails is reported in place of its figure; the portable one failing fails the run")
    p.add_argument("--cuda-graphs", action="store_true", help="also time pagedserve with cuda_graphs=True")
    p.add_argument("--sync-scheduling", action="store_true",
                   help="also time pagedserve with async_scheduling=False (each step scheduled after the last)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after each pagedserve run, profile this many decode steps (host time by phase; on CUDA "
                        "the device's busy fraction)")
    p.add_argument("--fp32-linears", action="store_true",
                   help="also time pagedserve with gguf_linears=False (a GGUF model's linear layers on fp32)")
    p.add_argument("--json", type=Path, default=None, help="write results here too")
    args = p.parse_args()
    if args.llama_server == []:
        args.llama_server = ["portable", "native"]
    env = announce()

    from pagedserve.config import EngineConfig
    from pagedserve.workers.loader import resolve_model

    device = torch.device(args.device)
    if args.gguf_type:
        from pagedserve.workers.gguf import embedded_model_gguf

        source = Path(args.model) if args.model else embedded_model_gguf()
        if source.suffix != ".gguf":
            raise SystemExit("--gguf-type needs a GGUF model (the embedded one, or --model file.gguf)")
        args.model = str(retyped_gguf(source, args.gguf_type) if args.gguf_type in ("BF16", "F16")
                         else quantized_gguf(retyped_gguf(source, "BF16"), args.gguf_type))
    if args.random:
        dtype = EngineConfig(dtype=args.dtype).torch_dtype(device, None)
        model_dir = make_random_checkpoint(args.random, dtype, args.device)
    else:
        model_dir = resolve_model(args.model).weights_dir
        dtype = EngineConfig(dtype=args.dtype).torch_dtype(device, None)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if args.workload == "nano-vllm":
        if vocab <= 10000:
            raise SystemExit(f"--workload nano-vllm draws token ids up to 10000: the model's vocab_size={vocab} is "
                             "too small")
        args.num_requests = args.num_requests or 256
        prompts, outputs = nano_vllm_workload(args.num_requests)
        args.temperature, args.top_p = 0.6, 1.0
    else:
        args.num_requests = args.num_requests or 32
        prompts, outputs = make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab,
                                         args.seed)
    print(f"model {model_dir.name}, {dtype}, {args.device}, {len(prompts)} requests, "
          f"{sum(map(len, prompts))} prompt tokens, {sum(outputs)} output tokens, threads {torch.get_num_threads()}")

    failed = None
    results = [] if args.skip_pagedserve else [bench_pagedserve(model_dir, prompts, outputs, args)]
    if args.cuda_graphs:
        results.append(bench_pagedserve(model_dir, prompts, outputs, args, cuda_graphs=True))
    if args.sync_scheduling:
        results.append(bench_pagedserve(model_dir, prompts, outputs, args, cuda_graphs=args.cuda_graphs,
                                        async_scheduling=False))
    if args.fp32_linears:
        results.append(bench_pagedserve(model_dir, prompts, outputs, args, gguf_linears=False))
    if not args.skip_hf:
        results.append(bench_hf_generate(model_dir, prompts, outputs, args, dtype))
        if args.hf_generate_batch:
            try:
                results.append(bench_hf_generate_batch(model_dir, prompts, outputs, args, dtype))
            except Exception as e:  # an optional peer: report, time the rest, fail at the end
                failed = f"HF generate_batch failed: {type(e).__name__}: {e}"
                print(failed)
    for build in args.llama_server or ():
        from pagedserve.workers.gguf import embedded_model_gguf

        gguf = Path(args.model) if args.model else embedded_model_gguf()
        if gguf.suffix != ".gguf":
            raise SystemExit("--llama-server needs a GGUF model (the embedded one, or --model file.gguf)")
        results.append(bench_llama_server(gguf, prompts, outputs, args, build))
        if "error" in results[-1] and build == "portable":
            failed = failed or f"{results[-1]['name']} failed: {results[-1]['error']}"
    timed = [r for r in results if "error" not in r]
    base = timed[0]["tokens"] / timed[0]["seconds"] if timed else None
    print("\n| engine | output tokens/s | seconds | pagedserve speed-up | note |\n| --- | ---: | ---: | ---: | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | failed | | | {r['error']} |")
            continue
        tps = r["tokens"] / r["seconds"]
        r["tokens_per_s"] = tps
        print(f"| {r['name']} | {tps:,.1f} | {r['seconds']:.1f} | {base / tps:.2f}x | {r['note']} |")
    if args.json:
        from peers import peer_versions

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "peers": peer_versions() if args.llama_server else {},
                                         "args": vars(args) | {"json": str(args.json)}, "results": results},
                                        indent=2, default=str))
    if failed:
        sys.exit(failed)


if __name__ == "__main__":
    main()
