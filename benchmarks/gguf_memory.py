"""Memory a GGUF model takes: to convert, to start and to serve, beside llama.cpp's llama-server on the same file.

The GGUF is made here: the embedded SmolLM2's fields and tokenizer with a larger body (by default Llama-3.2-1B's:
16 layers of 2,048, 8,192 in the MLP, 32 query and 8 KV heads; 1.07B weights on SmolLM2's 49,152-token
vocabulary) whose tensors are random K-type blocks as llama-quantize's Q4_K_M lays them out (Q4_K, Q6_K for v,
the MLP's down projections and the tied embedding), or with `--mix` another of its mixes (`MIXES`: Q5_K_M, Q5_K
where Q4_K_M has Q4_K; Q3_K_M, Q3_K with v and the output and down projections Q4_K; Q2_K, Q2_K with v and the
down projections Q3_K; IQ4_XS, IQ4_XS with the table Q6_K). Each pagedserve phase runs in a child process of its
own, so its peak resident memory (VmHWM) is its own:

- convert: the GGUF into the cache directory the engine loads (fresh cache);
- start: `LLM(gguf)` from that cache, then one greedy request of 16 tokens (the resident memory after it, the
  peak, and apart the peak of anonymous memory: the peak counts the checkpoint's pages while they are mapped, which
  the kernel can drop; the weights as held, the seconds to start);
- llama-server: started on the same file, the same request, its resident memory after it and its peak.

The children import the `pagedserve` that PYTHONPATH (or the install) gives, so a checkout of another commit can
be measured with the same script:

  python benchmarks/gguf_memory.py --llama-server [--mix Q5_K_M|Q3_K_M|Q2_K|IQ4_XS] [--keep DIR]
  PYTHONPATH=/path/to/other/checkout python benchmarks/gguf_memory.py
  python benchmarks/gguf_memory.py --gguf FILE --llama-server   # a GGUF made elsewhere (moe_gguf.py's)

`--keep DIR` leaves the GGUF in DIR, for `throughput.py --model DIR/<file>` on the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from environment import announce  # noqa: E402

PROMPT = "The capital of France is"

_CONVERT = """
import json, sys, time
from pathlib import Path
from pagedserve.workers.gguf import cached_gguf_dir
start = time.perf_counter()
cached_gguf_dir(Path(sys.argv[1]), cache_root=Path(sys.argv[2]))
print(json.dumps({"seconds": time.perf_counter() - start}))
"""

# Each layer tensor's type in llama-quantize's mixes (its first layers' extra bits left out); the tied table is Q6_K
# in every one
_LAYER_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
MIXES = {"Q4_K_M": dict.fromkeys(_LAYER_TENSORS, "Q4_K") | {"attn_v": "Q6_K", "ffn_down": "Q6_K"},
         "Q5_K_M": dict.fromkeys(_LAYER_TENSORS, "Q5_K") | {"attn_v": "Q6_K", "ffn_down": "Q6_K"},
         "Q3_K_M": dict.fromkeys(_LAYER_TENSORS, "Q3_K") | dict.fromkeys(("attn_v", "attn_output", "ffn_down"), "Q4_K"),
         "Q2_K": dict.fromkeys(_LAYER_TENSORS, "Q2_K") | {"attn_v": "Q3_K", "ffn_down": "Q3_K"},
         "IQ4_XS": dict.fromkeys(_LAYER_TENSORS, "IQ4_XS")}

# pagedserve is imported before throughput.py, which puts this checkout first on the path: the child measures the
# pagedserve that PYTHONPATH (or the install) gives.
_START = """
import json, re, sys, threading, time
from pagedserve import LLM, SamplingParams
sys.path.insert(0, sys.argv[3])
from throughput import weight_bytes
peak_anon = 0


def sample_anon():  # VmHWM counts the checkpoint's mapped pages too (clean, reclaimable): the anonymous peak apart
    global peak_anon
    while True:
        kib = int(re.search(r"RssAnon:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
        peak_anon = max(peak_anon, kib * 1024)
        time.sleep(0.005)


threading.Thread(target=sample_anon, daemon=True).start()
start = time.perf_counter()
with LLM(sys.argv[1], max_model_len=2048, kv_cache_memory=256 * 2**20) as llm:
    started = time.perf_counter() - start
    out = llm.generate([sys.argv[2]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    print(json.dumps({"seconds_to_start": started, "weights": weight_bytes(llm.llm_engine.executor.worker.model),
                      "tokens": out[0].outputs[0].token_ids, "status": open("/proc/self/status").read(),
                      "peak_anon": peak_anon}))
"""


def memory(status: str) -> dict:
    """VmRSS and VmHWM (the peak) of a /proc/<pid>/status text, in bytes."""
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


def child(code: str, *args: str, env: dict | None = None) -> tuple[dict, int]:
    """Run `code` in a fresh interpreter; its JSON line and its peak resident bytes. With -P the working directory
    is not put first on its path, so a checkout run from measures the pagedserve PYTHONPATH names."""
    proc = subprocess.Popen([sys.executable, "-P", "-c", code, *args], stdout=subprocess.PIPE, env=env, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # the child's own rusage: its peak resident memory
    if exit_code := os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"child exited with {exit_code}")
    return json.loads(out.strip().splitlines()[-1]), usage.ru_maxrss * 1024


def make_gguf(out: Path, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
              mix: str = "Q4_K_M") -> Path:
    """The embedded GGUF's fields (tokenizer, chat template) with a body of this shape, random K-type blocks."""
    import gguf
    import torch
    from cpu_ops import random_k_blocks
    from throughput import gguf_writer_like

    from pagedserve.workers.gguf import embedded_model_gguf

    reader = gguf.GGUFReader(embedded_model_gguf())
    arch = reader.fields["general.architecture"].contents()
    shape = {f"{arch}.block_count": layers, f"{arch}.embedding_length": hidden,
             f"{arch}.feed_forward_length": intermediate, f"{arch}.attention.head_count": heads,
             f"{arch}.attention.head_count_kv": kv_heads, f"{arch}.rope.dimension_count": hidden // heads}
    writer = gguf_writer_like(reader, out, shape)
    gen = torch.Generator().manual_seed(0)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    kv = hidden // heads * kv_heads

    def add(name: str, n: int, k: int, qtype: str) -> None:
        # d of 1e-4: activations stay finite through the layers, so both engines run real arithmetic
        rows = random_k_blocks(n, k, qtype, gen, d=1e-4)
        writer.add_tensor(name, rows.numpy(), raw_dtype=gguf.GGMLQuantizationType[qtype])

    add("token_embd.weight", vocab, hidden, "Q6_K")
    writer.add_tensor("output_norm.weight", torch.ones(hidden).numpy())
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", torch.ones(hidden).numpy())
        writer.add_tensor(p + "ffn_norm.weight", torch.ones(hidden).numpy())
        for name, n, k in (("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                           ("attn_output", hidden, hidden), ("ffn_gate", intermediate, hidden),
                           ("ffn_up", intermediate, hidden), ("ffn_down", hidden, intermediate)):
            add(p + name + ".weight", n, k, MIXES[mix][name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def pid_of(binary: str, argument: str) -> int:
    """The pid of the running `binary` whose command line holds `argument`."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(binary.encode()) and argument.encode() in cmd:
                return int(entry.name)
    raise LookupError(f"no {binary} running with {argument}")


def bench_llama_server(path: Path) -> dict:
    from peers import llama_server, post_json

    with llama_server(path, parallel=1, context_per_slot=2048) as url:
        body = {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "ignore_eos": True}
        post_json(url + "/completion", body)
        return memory((Path("/proc") / str(pid_of("llama-server", str(path))) / "status").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--mix", choices=sorted(MIXES), default="Q4_K_M", help="llama-quantize's type mix to lay out")
    p.add_argument("--keep", type=Path, help="write the GGUF into this directory and leave it there")
    p.add_argument("--llama-server", action="store_true", help="also llama.cpp's llama-server on the same file")
    p.add_argument("--gguf", type=Path, help="measure this GGUF instead of making one (the shape options unused)")
    args = p.parse_args()
    announce()
    mib = 2**20
    with tempfile.TemporaryDirectory(prefix="gguf-memory-") as d:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
        path = args.gguf or make_gguf((args.keep or Path(d)) / f"body.{args.mix}.gguf", args.layers, args.hidden,
                                      args.intermediate, args.heads, args.kv_heads, args.mix)
        print(f"GGUF: {path.stat().st_size / mib:,.0f} MiB")
        cache = Path(d) / "cache"
        converted, peak = child(_CONVERT, str(path), str(cache))
        print(f"convert: {converted['seconds']:.1f} s, peak {peak / mib:,.0f} MiB")
        env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(cache)}
        started, _ = child(_START, str(path), PROMPT, str(Path(__file__).resolve().parent), env=env)
        held = memory(started["status"])
        print(f"start: {started['seconds_to_start']:.1f} s, weights {started['weights'] / mib:,.0f} MiB, resident "
              f"{held['VmRSS'] / mib:,.0f} MiB after a request, peak {held['VmHWM'] / mib:,.0f} MiB (anonymous memory "
              f"at most {started['peak_anon'] / mib:,.0f} MiB, sampled every 5 ms)")
        print(f"tokens: {started['tokens']}")
        if args.llama_server:
            theirs = bench_llama_server(path)
            print(f"llama-server: resident {theirs['VmRSS'] / mib:,.0f} MiB after a request, peak "
                  f"{theirs['VmHWM'] / mib:,.0f} MiB")


if __name__ == "__main__":
    main()
