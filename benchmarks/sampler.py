"""The sampler's cost per step for a batch of rows: `Sampler.draw` on random logits, per mix of sampling
features, on the CPU and on CUDA when there is one (the draws read back: the step's whole sampling).

    python benchmarks/sampler.py [--rows 256] [--vocab 49152] [--iters 20] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from environment import announce  # noqa: E402

from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.scheduler.batch import SampleSpec  # noqa: E402
from pagedserve.workers.sampler import Sampler  # noqa: E402

MIXES = ("greedy", "temperature 0.8", "top-k 50", "top-k 50, top-p 0.9", "top-p 0.9",
         "top-p 0.9, every other row greedy", "logit_bias + bans", "grammar masks")


def specs(mix: str, rows: int, vocab: int) -> list[SampleSpec]:
    """Every row with the mix's features (a grammar mask allows a random tenth of the vocabulary), or every
    other row where the mix says so (the others greedy)."""
    rng = random.Random(0)
    out = []
    for r in range(rows):
        params, banned, bitmask = SamplingParams(temperature=0), None, None
        if mix == "temperature 0.8":
            params = SamplingParams(temperature=0.8)
        elif mix == "top-k 50":
            params = SamplingParams(temperature=0.8, top_k=50)
        elif mix == "top-k 50, top-p 0.9":
            params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
        elif mix == "top-p 0.9":
            params = SamplingParams(temperature=0.8, top_p=0.9)
        elif mix == "top-p 0.9, every other row greedy" and r % 2:
            params = SamplingParams(temperature=0.8, top_p=0.9)
        elif mix == "logit_bias + bans":
            params = SamplingParams(temperature=0, logit_bias={rng.randrange(vocab): 5.0 for _ in range(4)})
            banned = [rng.randrange(vocab) for _ in range(2)]
        elif mix == "grammar masks":
            words = [sum(1 << b for b in range(32) if rng.random() < 0.1) for _ in range(-(-vocab // 32))]
            bitmask = torch.tensor(words, dtype=torch.int64).to(torch.int32).numpy().tobytes()
        out.append(SampleSpec(seq_id=r, row=r, num_samples=1, sample_index=0, output_len=0, params=params,
                              banned_token_ids=banned, token_bitmask=bitmask))
    return out


def time_draws(device: torch.device, mix: str, args: argparse.Namespace) -> float:
    """Milliseconds per `draw` of `args.rows` rows, the draws read back (median of `args.iters`)."""
    sampler = Sampler(device, seed=0)
    # [R, V]; peaked like a language model's: a nucleus of p = 0.9 holds some hundred tokens, not thousands
    logits = 4 * torch.randn(args.rows, args.vocab, device=device, generator=torch.Generator(device).manual_seed(0))
    batch = specs(mix, args.rows, args.vocab)
    times = []
    for i in range(args.iters + 3):
        step_logits = logits.clone()  # the draw writes bias and bans into its logits
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sampler.draw(step_logits, batch).outputs()
        if i >= 3:  # past the warm-up (allocations, pinned blocks)
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", choices=("cpu", "cuda"), help="only this one (default: the CPU, and CUDA if there)")
    args = p.parse_args()
    announce()
    torch.set_num_threads(1)
    names = [args.device] if args.device else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    devices = [torch.device(name) for name in names]
    print(f"{args.rows} rows, vocabulary {args.vocab}, ms per draw (median of {args.iters}):")
    for device in devices:
        for mix in MIXES:
            print(f"  {device.type:5s} {mix:34s} {time_draws(device, mix, args):8.2f}")


if __name__ == "__main__":
    main()
