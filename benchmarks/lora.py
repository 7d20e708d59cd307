"""LoRA adapters mixed in one batch, beside the base model alone, in the same run, on the embedded SmolLM2.

  python benchmarks/lora.py [--adapters 1 4 16] [--requests 32] [--output-tokens 64] [--device cuda] [--json F]

Adapters of rank 16 over all seven projections, made by PEFT from random initialization (its own format, written
to a temporary directory). The same prompts (chat questions, greedy, every output as long as the others) run on
the base model alone, then with 1, 4 and 16 adapters mixed round robin over the requests, all adapters in slots
(`max_loras` = their number), and with 16 adapters through 4 slots (swapped under load). Output tokens/s of each,
and its ratio to the base model's.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from environment import announce  # noqa: E402

RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOPICS = ["rivers", "bridges", "owls", "clocks", "bread", "glass", "maps", "bees", "ships", "salt", "tea", "wool",
          "kites", "caves", "ink", "snow"]


def make_adapters(weights_dir: Path, out: Path, count: int) -> list[Path]:
    """`count` PEFT adapters over the model, A and B drawn at random (PEFT starts B at zeros: no change)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(weights_dir, dtype=torch.float32)
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(copy.deepcopy(base), LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS))
        for name, param in model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(param, std=0.02)
        model.save_pretrained(out / f"adapter{i}")
        paths.append(out / f"adapter{i}")
    return paths


def run(adapters: list[Path], slots: int, prompts: list[list[dict]], output_tokens: int, device: str) -> dict:
    """Output tokens/s of `prompts` (all at once), request i with adapter i % len(adapters) (none: the base)."""
    from pagedserve import LLM, LoRARequest, SamplingParams

    lora = {"enable_lora": True, "max_loras": slots, "max_lora_rank": RANK} if adapters else {}
    llm = LLM(max_num_seqs=len(prompts), device=device, **lora)
    requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    chosen = [requests[i % len(requests)] if requests else None for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    template = llm.llm_engine.inputs
    ids = [template.chat_plan(m, params).prompt_token_ids for m in prompts]
    llm.generate(ids[:2], params, lora_request=chosen[:2])  # warm-up: reads the first adapters, builds kernels
    t0 = time.perf_counter()
    outs = llm.generate(ids, params, lora_request=chosen)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return {"adapters": len(adapters), "slots": slots, "tokens_per_s": produced / elapsed, "seconds": elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--swapped", type=int, nargs=2, default=[16, 4], metavar=("ADAPTERS", "SLOTS"),
                   help="a run with more adapters than slots")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    env = announce()
    from pagedserve.workers.loader import resolve_model

    prompts = [[{"role": "user", "content": f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}."}]
               for i in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(resolve_model(None).weights_dir, Path(tmp), max(*args.adapters, args.swapped[0]))
        rows = [run([], 1, prompts, args.output_tokens, args.device)]
        rows += [run(paths[:n], n, prompts, args.output_tokens, args.device) for n in args.adapters]
        rows.append(run(paths[:args.swapped[0]], args.swapped[1], prompts, args.output_tokens, args.device))
    base = rows[0]["tokens_per_s"]
    print(f"\n{args.requests} requests, {args.output_tokens} output tokens each, greedy, rank {RANK} everywhere")
    print("| adapters | slots | output tokens/s | vs the base model alone |")
    print("| ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['adapters'] or 'none'} | {row['slots'] if row['adapters'] else '-'} | "
              f"{row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base:.2f}x |")
    if args.json is not None:
        args.json.write_text(json.dumps({"environment": env, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
