"""Greedy agreement of a half-precision run against fp32 on the same model: how often bf16 (or fp16) changes
what the model answers, and where the two token streams part.

  .venv/bin/python benchmarks/dtype_agreement.py                       # embedded SmolLM2, bf16 vs fp32
  .venv/bin/python benchmarks/dtype_agreement.py --dtype float16 --max-tokens 128

Prompts are chat questions through the model's template (real text, not random ids). Reported: the share of
answers identical token for token, the mean share of each answer's tokens before the first difference, and
the fp32 top-2 logit gap at each first difference (a small gap: a near-tie that any rounding can flip).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from environment import announce  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.", "What is 17 times 23?", "Name three primary colors.",
    "How do vaccines work?", "Give me a recipe for pancakes.", "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?", "What is a prime number?",
    "Summarize the plot of Romeo and Juliet.", "List four planets of the solar system.",
    "What does a CPU do?", "How many legs does a spider have?", "Describe the water cycle.",
    "What is the boiling point of water in Fahrenheit?", "Who wrote 'Pride and Prejudice'?",
    "Give two tips for better sleep.", "What is machine learning?", "Write a short poem about autumn.",
    "How does a rainbow form?", "What is the largest ocean?", "Explain what an API is.",
    "Why do leaves change color in the fall?", "What is the speed of light?",
    "Suggest a name for a pet turtle.", "How do airplanes stay in the air?", "What is gravity?",
    "Give an example of a renewable energy source.", "What is the difference between weather and climate?",
    "Tell me a fun fact about octopuses.",
]


def run(dtype: str, prompts: list[list[int]], max_tokens: int, logprobs: int | None):
    from pagedserve import LLM, SamplingParams

    llm = LLM(dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    del llm
    return [o.outputs[0] for o in outs], elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=len(QUESTIONS))
    args = p.parse_args()
    announce()

    from transformers import AutoTokenizer

    from pagedserve.workers.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).tokenizer_dir)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])
               for q in QUESTIONS[:args.num_prompts]]
    ref, ref_s = run("float32", prompts, args.max_tokens, logprobs=2)
    half, half_s = run(args.dtype, prompts, args.max_tokens, logprobs=None)
    identical, prefix_share, gaps = 0, [], []
    for r, h in zip(ref, half, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(r.token_ids, h.token_ids, strict=True)) if a != b), None)
        if first is None:
            identical += 1
            prefix_share.append(1.0)
            continue
        prefix_share.append(first / len(r.token_ids))
        top = r.logprobs[first].top_logprobs  # fp32's own top-2 at the first difference
        if len(top) >= 2:
            gaps.append(top[0].logprob - top[1].logprob)
    n = len(prompts)
    print(f"{n} chat prompts, {args.max_tokens} greedy tokens each, embedded SmolLM2-135M-Instruct")
    print(f"identical answers ({args.dtype} vs float32): {identical}/{n} = {identical / n:.0%}")
    print(f"mean share of tokens before the first difference: {sum(prefix_share) / n:.0%}")
    if gaps:
        gaps.sort()
        print(f"fp32 top-2 logprob gap at the first difference: median {gaps[len(gaps) // 2]:.3f}, max {gaps[-1]:.3f}")
    print(f"time: float32 {ref_s:.1f} s, {args.dtype} {half_s:.1f} s")


if __name__ == "__main__":
    main()
