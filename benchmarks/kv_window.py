"""KV memory a sequence holds with sliding-window layers: bounded by the window (a KV-cache group per attention
type) against every layer holding every position (one group, as without windows).

Nothing runs on a device: the block manager allocates for real (the scheduler's chunked prefill, then decode
steps), and a sequence's memory is the blocks it holds in each group, times that group's bytes per block. Two
layouts, bf16, 16-token blocks:

- Mistral-7B-shaped: 32 layers, 8 KV heads of 128, every layer a window of 4,096;
- Gemma-3-shaped (12B): 48 layers, 8 KV heads of 256, five sliding layers (a window of 1,024) to one full.

For each, at 8k and 32k tokens: what one sequence holds once it decodes there, bounded and full; and how many
such sequences a 40 GiB pool holds at once, the pool split between the groups as the workers split it
(`split_kv_budget`, which sizes a sliding group for `max_num_seqs` sequences: 256, the default, and 32).

  python benchmarks/kv_window.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from environment import announce  # noqa: E402

from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.scheduler.block_manager import BlockManager  # noqa: E402
from pagedserve.scheduler.kv_groups import KVGroup, kv_groups  # noqa: E402
from pagedserve.scheduler.request import Request, Sequence  # noqa: E402
from pagedserve.workers.kv_pool import split_kv_budget  # noqa: E402

BLOCK_SIZE = 16
CHUNK = 8192  # the CUDA engines' default token budget per step
MAX_NUM_SEQS = (256, 32)
DTYPE_BYTES = 2  # bf16
BUDGET = 40 * 2**30

LAYOUTS = {
    "Mistral-7B shape (32 layers, all window 4096)": dict(windows=[4096] * 32, kv_heads=8, head_dim=128),
    "Gemma-3-12B shape (48 layers, 5 x window 1024 : 1 full)": dict(
        windows=[None if (i + 1) % 6 == 0 else 1024 for i in range(48)], kv_heads=8, head_dim=256),
}


def block_bytes(group: KVGroup, kv_heads: int, head_dim: int) -> int:
    return len(group.layers) * 2 * BLOCK_SIZE * kv_heads * head_dim * DTYPE_BYTES


def run_to(bm: BlockManager, seq: Sequence, length: int, decode: int) -> None:
    """Prefill `seq` to `length - decode` tokens in chunks of CHUNK, then decode to `length`, a token a step
    (MemoryError when a pool is short)."""
    while seq.num_computed_tokens < length:
        num_new = max(1, min(CHUNK, length - decode - seq.num_computed_tokens))
        if bm.allocate_slots(seq, num_new) is None:
            raise MemoryError
        seq.num_computed_tokens += num_new
        bm.cache_full_blocks(seq)


def new_seq(seq_id: int, length: int) -> Sequence:
    tokens = [(seq_id * 7919 + i) % 50000 for i in range(length)]
    return Sequence(seq_id, Request(f"r{seq_id}", tokens, SamplingParams(max_tokens=1)), list(tokens), 0)


def held_bytes(bm: BlockManager, seq: Sequence, group_bytes: list[int]) -> int:
    return sum(sum(1 for b in table if b >= pool.reserved) * nbytes
               for table, pool, nbytes in zip(seq.block_tables, bm.pools, group_bytes, strict=True))


def one_sequence(windows: list[int | None], kv_heads: int, head_dim: int, length: int) -> dict:
    """The bytes one sequence of `length` tokens holds with its layout's groups, once it decodes there."""
    groups = kv_groups(windows)
    group_bytes = [block_bytes(g, kv_heads, head_dim) for g in groups]
    bm = BlockManager([length // BLOCK_SIZE + 8] * len(groups), BLOCK_SIZE, windows=[g.window for g in groups])
    seq = new_seq(0, length)
    run_to(bm, seq, length, decode=64)
    held = held_bytes(bm, seq, group_bytes)
    per_group = [sum(1 for b in t if b >= p.reserved) for t, p in zip(seq.block_tables, bm.pools, strict=True)]
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_total_blocks
    return {"bytes": held, "blocks_per_group": per_group, "groups": [g.window for g in groups]}


def sequences_in_budget(windows: list[int | None], kv_heads: int, head_dim: int, length: int,
                        max_num_seqs: int) -> int:
    """How many sequences of `length` tokens a BUDGET-byte pool holds at once, each run there in turn."""
    groups = kv_groups(windows)
    group_bytes = [block_bytes(g, kv_heads, head_dim) for g in groups]
    counts = split_kv_budget(BUDGET, groups, group_bytes, BLOCK_SIZE, max_num_seqs, CHUNK)
    bm = BlockManager(counts, BLOCK_SIZE, enable_prefix_caching=False, windows=[g.window for g in groups])
    n = 0
    while n < max_num_seqs:
        seq = new_seq(n, length)
        try:
            run_to(bm, seq, length, decode=64)
        except MemoryError:
            bm.free(seq)
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    env = announce()
    rows = []
    print(f"\n{'layout':58} {'tokens':>6} {'bounded MiB':>12} {'full MiB':>9} {'ratio':>6}   sequences in 40 GiB, "
          "bounded / full, max_num_seqs " + " and ".join(map(str, MAX_NUM_SEQS)))
    for name, layout in LAYOUTS.items():
        full_layout = dict(layout, windows=[None] * len(layout["windows"]))
        for length in (8192, 32768):
            bounded = one_sequence(length=length, **layout)
            full = one_sequence(length=length, **full_layout)
            fits = {n: (sequences_in_budget(length=length, max_num_seqs=n, **layout),
                        sequences_in_budget(length=length, max_num_seqs=n, **full_layout)) for n in MAX_NUM_SEQS}
            rows.append(dict(layout=name, tokens=length, bounded=bounded, full=full, seqs_in_budget=fits))
            print(f"{name:58} {length:>6} {bounded['bytes'] / 2**20:>12,.0f} {full['bytes'] / 2**20:>9,.0f} "
                  f"{full['bytes'] / bounded['bytes']:>5.1f}x   "
                  + "   ".join(f"{b} / {f}" for b, f in fits.values()))
            print(f"{'':58} {'':>6} blocks per group {bounded['blocks_per_group']} (windows {bounded['groups']})")
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
