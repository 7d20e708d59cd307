"""KV memory a sequence holds with sliding-window layers: bounded by the window (a KV-cache group per attention
type) against every layer holding every position (one group, as without windows).

Nothing runs on a device: the block manager allocates for real (the scheduler's chunked prefill, then decode
steps), and a sequence's memory is the blocks it holds over all groups, times the shared pool's bytes per block
(the groups hold equally many layers: a block is one page of each of a group's layers). Two layouts, bf16,
16-token blocks:

- Mistral-7B-shaped: 32 layers, 8 KV heads of 128, every layer a window of 4,096;
- Gemma-3-shaped (12B): 48 layers, 8 KV heads of 256, five sliding layers (a window of 1,024) to one full.

For each, at 8k and 32k tokens: what one sequence holds once it decodes there, bounded and full; and how many
such sequences a 40 GiB pool holds at once, every group drawing from the one pool as the workers allocate it, up
to `max_num_seqs` (256, the default, and 32).

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
from pagedserve.scheduler.kv_groups import KVGroup, kv_groups, layers_per_group  # noqa: E402
from pagedserve.scheduler.request import Request, Sequence  # noqa: E402

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


def block_bytes(groups: list[KVGroup], kv_heads: int, head_dim: int) -> int:
    """A block of the shared pool: a page of K and V for each of a group's layers."""
    return layers_per_group(groups) * 2 * BLOCK_SIZE * kv_heads * head_dim * DTYPE_BYTES


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


def one_sequence(windows: list[int | None], kv_heads: int, head_dim: int, length: int) -> dict:
    """The bytes one sequence of `length` tokens holds with its layout's groups, once it decodes there."""
    groups = kv_groups(windows)
    bm = BlockManager((length // BLOCK_SIZE + 8) * len(groups), BLOCK_SIZE, windows=[g.window for g in groups])
    seq = new_seq(0, length)
    run_to(bm, seq, length, decode=64)
    per_group = [sum(1 for b in table if b >= bm.pool.reserved) for table in seq.block_tables]
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_total_blocks
    return {"bytes": sum(per_group) * block_bytes(groups, kv_heads, head_dim), "blocks_per_group": per_group,
            "groups": [(g.window, len(g.layers)) for g in groups]}


def sequences_in_budget(windows: list[int | None], kv_heads: int, head_dim: int, length: int,
                        max_num_seqs: int) -> int:
    """How many sequences of `length` tokens a BUDGET-byte pool holds at once, each run there in turn."""
    groups = kv_groups(windows)
    num_blocks = BUDGET // block_bytes(groups, kv_heads, head_dim)
    bm = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False, windows=[g.window for g in groups])
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
            print(f"{'':58} {'':>6} blocks per group {bounded['blocks_per_group']} "
                  f"((window, layers) {bounded['groups']})")
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
