"""Greedy parity on the GPU: pagedserve's Triton path against HF transformers on one random-weight model.

    PYTHONPATH=. python benchmarks/gpu_parity.py                         # Qwen2.5-0.5B shape, fp32, CUDA
    PYTHONPATH=. python benchmarks/gpu_parity.py --cuda-graphs           # the same through decode CUDA graphs
    PYTHONPATH=. python benchmarks/gpu_parity.py --smoke                 # tiny shape on CPU (Triton interpreter)

Each prompt is generated alone by HF (`generate`, greedy, no padding) and all together by pagedserve.
Where the token streams part, HF's own top-2 logit gap at that step tells a real error from a near-tie
that the order of fp32 sums can flip (gap < --tie-gap): a tie ends the comparison of that prompt and is
reported; any other difference fails. Exit status 0 only when every prompt matches or parts at a tie.
Needs only torch, triton and transformers (no ray, no gguf).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from environment import announce  # noqa: E402
from throughput import PRESETS, make_random_checkpoint  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(5, 300))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--kv-cache-memory", default=None, help="the KV pool's size (default: gpu_memory_utilization's)")
    p.add_argument("--tie-gap", type=float, default=1e-3, help="logit gap under which a parting is a tie")
    p.add_argument("--smoke", action="store_true", help="qwen2-tiny on CPU, 4 prompts")
    args = p.parse_args()
    announce()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.preset, args.num_prompts, args.prompt_len, args.max_tokens = "qwen2-tiny", 4, (5, 40), 8
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 products on both sides
    torch.backends.cudnn.allow_tf32 = False

    model_dir = make_random_checkpoint(args.preset, dtype, device)
    vocab = PRESETS[args.preset]["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(*args.prompt_len))]
               for _ in range(args.num_prompts)]

    from pagedserve import LLM, SamplingParams

    with LLM(str(model_dir), dtype=args.dtype, device=device, attention_backend="triton",
             cuda_graphs=args.cuda_graphs, max_num_seqs=args.num_prompts, kv_cache_memory=args.kv_cache_memory) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
        ours = [o.outputs[0].token_ids for o in outs]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device)
    model.eval()
    exact = ties = 0
    failures = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                                return_dict_in_generate=True)
        theirs = hf.sequences[0, len(prompt):].tolist()
        if ours[i] == theirs:
            exact += 1
            continue
        step = next(t for t, (a, b) in enumerate(zip(ours[i], theirs, strict=True)) if a != b)
        top2 = hf.scores[step][0].float().topk(2).values
        gap = float(top2[0] - top2[1])
        line = f"prompt {i} ({len(prompt)} tokens) parts at step {step}: ours {ours[i][step]}, HF {theirs[step]}, " \
               f"HF top-2 gap {gap:.2e}"
        if gap < args.tie_gap:
            ties += 1
            print("tie:", line)
        else:
            failures.append(line)
            print("MISMATCH:", line)
    print(f"{args.preset} {args.dtype} on {device}, cuda_graphs={args.cuda_graphs}: {exact}/{len(prompts)} "
          f"prompts identical over {args.max_tokens} tokens, {ties} parted at a near-tie, {len(failures)} mismatched")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
