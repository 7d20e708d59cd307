"""Served throughput and latency: pagedserve's OpenAI route (`serve run`) and llama.cpp's llama-server on the
same GGUF, under the same load from guidellm (a third-party load generator, in its own virtualenv), one run.

  bash benchmarks/setup_peers.sh                    # once: builds llama-server (twice), installs guidellm
  .venv/bin/python benchmarks/serving.py            # 16 concurrent streams, 256-token prompts, 64 out
  .venv/bin/python benchmarks/serving.py --streams 16 --requests 32 --prompt-tokens 256 --output-tokens 64 \\
      --engines pagedserve llama-server --out-dir /tmp/serving --json /tmp/serving.json

pagedserve runs deploy/config.yaml as `make run` does, with its gRPC proxy left out (guidellm speaks HTTP;
HTTP listens on 127.0.0.1 only). llama-server gets one slot per stream (`-np`): `llama-server` is
setup_peers.sh's portable AVX2 build, `llama-server-native` the one built for this CPU (-DGGML_NATIVE=ON, its
AMX kernels left out), as pagedserve's kernels are. A native build that fails (one with the AMX kernels died at
load on an AMX-capable Xeon VM; one crashed on AMD EPYC machines) is reported in place of its figures.
guidellm sends chat completions with max_tokens and ignore_eos, so every request produces exactly
--output-tokens tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from environment import announce  # noqa: E402
from peers import (  # noqa: E402
    LLAMA_BUILD_TITLES,
    llama_cpu_features,
    llama_server,
    peer_binary,
    peer_versions,
    server_process,
)

ROOT = Path(__file__).resolve().parent.parent
PAGEDSERVE_PORT = 8000  # deploy/config.yaml's http_options.port


@contextmanager
def pagedserve_server(log_path: Path, overrides: dict):
    """`serve run` on deploy/config.yaml without the gRPC proxy; yields the HTTP base URL."""
    import yaml

    config = yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text())
    config.pop("grpc_options", None)
    config["applications"][0]["args"].update(overrides)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    serve = Path(sys.executable).with_name("serve")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    url = f"http://127.0.0.1:{PAGEDSERVE_PORT}"
    try:
        with server_process([str(serve), "run", f.name], url + "/v1/models", log_path, 300, env=env, cwd=ROOT):
            yield url
    finally:
        os.unlink(f.name)


def run_guidellm(url: str, model: str, tokenizer_dir: Path, args, out: Path) -> dict:
    cmd = [str(peer_binary("guidellm")), "run",
           "--backend", f"kind=openai_http,target={url},model={model}",
           "--profile", f"kind=concurrent,streams={args.streams}",
           "--constraint", f"kind=max_requests,count={args.requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
           "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    subprocess.run(cmd, check=True, env=os.environ | {"HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                   cwd=out.parent)
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    ok = m["request_totals"]["successful"]
    return {"requests": ok, "errored": m["request_totals"]["errored"],
            "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
            "ttft_p50_ms": m["time_to_first_token_ms"]["successful"]["median"],
            "itl_p50_ms": m["inter_token_latency_ms"]["successful"]["median"],
            "itl_p95_ms": m["inter_token_latency_ms"]["successful"]["percentiles"]["p95"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--engines", nargs="+", default=["pagedserve", "llama-server", "llama-server-native"],
                   choices=["pagedserve", "llama-server", "llama-server-native"])
    p.add_argument("--out-dir", type=Path, default=None, help="guidellm JSON and server logs (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None,
                   help="the run's description and results here (default: summary.json in --out-dir)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="pagedserve engine settings over deploy/config.yaml's args (values parsed as YAML)")
    args = p.parse_args()
    env = announce()

    from pagedserve.workers.gguf import embedded_model_gguf
    from pagedserve.workers.loader import resolve_model

    # Absolute: guidellm runs in it, and is given paths inside it.
    out_dir = (args.out_dir or Path(tempfile.mkdtemp(prefix="pagedserve-serving-"))).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    source = resolve_model(None)
    results = {}
    for engine in args.engines:
        t0 = time.monotonic()
        if engine == "pagedserve":
            import yaml

            overrides = {"max_num_seqs": max(args.streams, 16)}
            overrides |= {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
            server = pagedserve_server(out_dir / "pagedserve.log", overrides)
        else:
            # Chat-template overhead: guidellm's prompt plus the template's tokens must fit a slot.
            slot = 2 * (args.prompt_tokens + args.output_tokens) + 256
            build = "native" if engine == "llama-server-native" else "portable"
            server = llama_server(embedded_model_gguf(), parallel=args.streams, context_per_slot=slot,
                                  log_path=out_dir / f"{engine}.log", build=build)
        features = None
        try:
            if engine != "pagedserve":
                features = llama_cpu_features(build)
            with server as url:
                results[engine] = run_guidellm(url, source.name, source.tokenizer_dir, args,
                                               out_dir / f"{engine}.json")
        except Exception as e:
            if engine != "llama-server-native":
                raise
            # The native build may crash on this CPU: that is its result, and the run goes on.
            results[engine] = {"error": f"{type(e).__name__}: {e}"}
        if engine != "pagedserve":
            results[engine] |= {"build": LLAMA_BUILD_TITLES[build], "cpu_features": features}
        print(f"{engine}: {results[engine]} ({time.monotonic() - t0:.0f} s)", flush=True)

    print(f"\n{args.streams} concurrent streams, {args.requests} requests, {args.prompt_tokens} prompt tokens, "
          f"{args.output_tokens} output tokens (guidellm; results in {out_dir})\n")
    ours = results.get("pagedserve", {}).get("output_tok_s")
    print("| server | output tokens/s | pagedserve speed-up | TTFT p50 ms | ITL p50 ms | ITL p95 ms "
          "| requests ok / errored |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for engine, r in results.items():
        name = engine + (f" ({r['build']})" if "build" in r else "")
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | | | | |")
            continue
        ratio = f"{ours / r['output_tok_s']:.2f}x" if ours and r["output_tok_s"] else ""
        print(f"| {name} | {r['output_tok_s']:.1f} | {ratio} | {r['ttft_p50_ms']:.0f} | {r['itl_p50_ms']:.0f} | "
              f"{r['itl_p95_ms']:.0f} | {r['requests']} / {r['errored']} |")
    for engine, r in results.items():
        if r.get("cpu_features"):
            print(f"{engine}: ggml CPU features {r['cpu_features']}")
    summary = args.json or out_dir / "summary.json"
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(json.dumps({"environment": env, "peers": peer_versions(),
                                   "args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                  indent=2))


if __name__ == "__main__":
    main()
