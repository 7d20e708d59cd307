"""Beam search: pagedserve beside transformers' `generate(num_beams=...)` on the same model and prompts, same
machine, one run; and whether the beams are the same.

pagedserve runs every prompt's search at once (`LLM.generate`, one request per beam per step, batched by
the scheduler); transformers runs its batched beam search over the prompts left-padded into one batch, and
one prompt at a time (no padding: the beams the engine is compared with). Output tokens/s counts the tokens
of every returned beam.

  python benchmarks/beam_search.py [--prompts 8] [--width 4] [--max-tokens 32] [--length-penalty 1.0]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from environment import announce  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.workers.loader import resolve_model  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name a color.", "Write a haiku about the sea.",
             "Why is the sky blue?", "Give me three tips for learning to cook.", "What is a prime number?",
             "Translate 'good morning' into Spanish.", "Describe a cat in one sentence.",
             "What does a CPU do?", "Suggest a name for a pet fish.", "How many legs does a spider have?",
             "What is the boiling point of water?", "Tell me a fun fact about space.", "What is 12 times 12?",
             "Who wrote Romeo and Juliet?", "What is photosynthesis?"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    announce()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    source = resolve_model(None)
    llm = LLM(str(source.weights_dir))
    model = AutoModelForCausalLM.from_pretrained(source.weights_dir, dtype=torch.float32).eval()
    eos = list(llm.llm_engine.eos_token_ids)
    prompts = [llm.llm_engine.inputs.chat_prompt([{"role": "user", "content": q}])
               for q in (QUESTIONS * (args.prompts // len(QUESTIONS) + 1))[:args.prompts]]
    params = SamplingParams(n=args.width, use_beam_search=True, length_penalty=args.length_penalty,
                            max_tokens=args.max_tokens, temperature=0)
    llm.generate(prompts[:1], params)  # warm-up

    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    ours_s = time.perf_counter() - t0
    ours = [[c.token_ids for c in o.outputs] for o in outs]

    generate = dict(num_beams=args.width, num_return_sequences=args.width, max_new_tokens=args.max_tokens,
                    do_sample=False, length_penalty=args.length_penalty, eos_token_id=eos, pad_token_id=eos[0])

    def trimmed(rows: list[list[int]]) -> list[list[int]]:
        return [row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in rows]

    with torch.no_grad():
        width = max(map(len, prompts))
        ids = torch.tensor([[eos[0]] * (width - len(q)) + q for q in prompts])
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts])
        t0 = time.perf_counter()
        batched = model.generate(ids, attention_mask=mask, **generate)
        hf_batch_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        singles = []
        for q in prompts:
            x = torch.tensor([q])
            beams = model.generate(x, attention_mask=torch.ones_like(x), **generate)
            singles.append(trimmed(beams[:, len(q):].tolist()))
        hf_single_s = time.perf_counter() - t0
    batched_rows = trimmed(batched[:, width:].tolist())
    hf_batch_tokens = sum(map(len, batched_rows))
    tokens = sum(len(t) for beams in ours for t in beams)
    single_tokens = sum(len(t) for beams in singles for t in beams)
    same = sum(a == b for a, b in zip(ours, singles, strict=True))
    print(f"{args.prompts} prompts, {args.width} beams, max_tokens {args.max_tokens}, length_penalty "
          f"{args.length_penalty}; torch threads {torch.get_num_threads()}")
    print(f"  pagedserve (all prompts at once)           {ours_s:7.2f} s  {tokens / ours_s:7.1f} beam tokens/s")
    print(f"  transformers, one padded batch             {hf_batch_s:7.2f} s  {hf_batch_tokens / hf_batch_s:7.1f} "
          f"beam tokens/s  pagedserve's time / this: {ours_s / hf_batch_s:.2f}")
    print(f"  transformers, one prompt at a time         {hf_single_s:7.2f} s  {single_tokens / hf_single_s:7.1f} "
          f"beam tokens/s  pagedserve's time / this: {ours_s / hf_single_s:.2f}")
    print(f"  prompts whose beams equal transformers' (one at a time): {same}/{len(prompts)}")
    llm.shutdown()


if __name__ == "__main__":
    main()
