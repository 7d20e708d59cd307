"""`pagedserve generate "prompt" [--chat] ...`: one generation from the command line; `pagedserve client
...` talks to a running server instead (pagedserve/client/commands.py)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from pagedserve.client.commands import register as register_client
from pagedserve.client.commands import run as run_client


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="pagedserve: a PagedAttention LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt with the offline engine")
    gen.add_argument("prompt", help="the prompt text (or the user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--model", default=None,
                     help="checkpoint dir, .gguf file or random:<config.json> (default: embedded SmolLM2)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--kv-cache-memory", default=None, help="KV pool size, e.g. 1GiB (CPU default: at most 1GiB)")
    gen.add_argument("--kv-offload-disk", default=None, metavar="SIZE",
                     help="a second tier for the prefix cache: blocks evicted from the pool kept in a file on local "
                          "disk of this size (e.g. 8GiB), copied back on a hit")
    gen.add_argument("--kv-offload-memory", default=None, metavar="SIZE",
                     help="a second tier in pinned host memory beside a GPU's pool (e.g. 16GiB)")
    gen.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                     help="where --kv-offload-disk's file goes (default: the cache directory)")
    gen.add_argument("--executor", choices=["local", "ray"], default="local",
                     help="ray: worker actors on the Ray cluster of RAY_ADDRESS (else a local one)")
    gen.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    gen.add_argument("--gpus-per-worker", type=float, default=1.0,
                     help="the share of a GPU each Ray worker reserves (0.5: two ranks on one GPU)")
    gen.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                     help="replay decode steps from CUDA graphs (default: on CUDA)")
    gen.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                     help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                          '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'')
    gen.add_argument("--lora", default=None, metavar="DIR",
                     help="a LoRA adapter in PEFT's format (adapter_config.json, adapter_model.safetensors)")
    gen.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank (with --lora)")
    gen.add_argument("--stats", action="store_true", help="print engine stats to stderr afterwards")
    register_client(sub)
    return parser


def _json_object(text: str) -> dict:
    """A JSON object from the command line, or argparse's error naming the option."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "client":  # run_client imports grpc; the offline path below never does
        return run_client(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from pagedserve import LLM, LoRARequest, SamplingParams

    try:
        adapter = None if args.lora is None else LoRARequest("adapter", 1, args.lora)
        lora = {} if adapter is None else {"enable_lora": True, "max_lora_rank": args.max_lora_rank}
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens)
        llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
                  kv_offload_disk=args.kv_offload_disk, kv_offload_memory=args.kv_offload_memory,
                  kv_offload_dir=args.kv_offload_dir, executor=args.executor,
                  tensor_parallel_size=args.tensor_parallel_size, gpus_per_worker=args.gpus_per_worker,
                  cuda_graphs=args.cuda_graphs,
                  speculative_config=args.speculative_config, **lora)
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": args.prompt})
            out = llm.chat(messages, params, lora_request=adapter)[0]
        else:
            out = llm.generate([args.prompt], params, lora_request=adapter)[0]
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for completion in out.outputs:
        if len(out.outputs) > 1:
            print(f"--- sample {completion.index} ({completion.finish_reason})")
        print(completion.text)
    if args.stats:
        print(llm.stats(), file=sys.stderr)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
