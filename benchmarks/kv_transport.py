"""K/V pages from one actor to another on a CPU node: Ray's object store (the path KV transfers take: each rank's pages
as a numpy array of bytes) against Ray's direct tensor transport over gloo (`tensor_transport="gloo"`, the two actors
in a collective group), for the same bytes, in one run.

  scripts/loopback-netns.sh .venv/bin/python benchmarks/kv_transport.py
  scripts/loopback-netns.sh .venv/bin/python benchmarks/kv_transport.py --blocks 1 8 64 256 --repeats 7
  scripts/netns-cluster.sh exec NAME 0 .venv/bin/python benchmarks/kv_transport.py --address auto --across-nodes

With --address, on a running cluster instead of a one-node one started here; with --across-nodes, the holder on one
node and the receiver on another (the first two alive nodes), so that every byte crosses the network between them.
Gloo finds its address from the host name, which resolves to a loopback address on many machines: between nodes,
name the interface in GLOO_SOCKET_IFNAME (eth0 on scripts/netns-cluster.sh's nodes); the actors get it.

A block's pages are the embedded SmolLM2-135M-Instruct's in fp32 (30 layers x K and V x 16 tokens x 3 KV heads x
64 dims x 4 bytes: 720 KiB). Each transfer: the holder makes the pages (a fresh tensor each time, as an export reads
them out of the pool), the receiver gets them and copies them into a preallocated buffer (as an import step copies
them into blocks); timed from the driver's first call to the receiver's answer. Reported per size: the median of
--repeats transfers after one not timed, and the bandwidth it gives.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import ray
import torch
from environment import announce
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4


@ray.remote(num_cpus=0)
class PageActor:
    """A replica's worker, holding or receiving pages. One class for both ends: Ray 2.60's gloo transport hung (no
    transfer, its 60 s timeout) between actors of two classes, and works between actors of one, as workers are."""

    def __init__(self, max_blocks: int) -> None:
        self.buffer = torch.empty(max_blocks * BLOCK_BYTES, dtype=torch.uint8)  # (bytes,) where pages land

    def pages(self, n: int) -> np.ndarray:
        return torch.ones(n * BLOCK_BYTES, dtype=torch.uint8).numpy()

    @ray.method(tensor_transport="gloo")
    def pages_direct(self, n: int) -> torch.Tensor:
        return torch.ones(n * BLOCK_BYTES, dtype=torch.uint8)

    def stage(self, pages) -> int:
        pages = torch.from_numpy(pages) if isinstance(pages, np.ndarray) else pages
        self.buffer[:pages.numel()].copy_(pages)
        return pages.numel()


def timed(holder, receiver, method: str, n: int, repeats: int) -> float:
    def once() -> float:
        start = time.perf_counter()
        assert ray.get(receiver.stage.remote(getattr(holder, method).remote(n))) == n * BLOCK_BYTES
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(repeats))


def placements(across_nodes: bool) -> tuple[dict, dict]:
    """Actor options for the holder and the receiver: anywhere, or pinned to the first two alive nodes."""
    if not across_nodes:
        return {}, {}
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeManagerAddress"])
    if len(nodes) < 2:
        raise SystemExit(f"--across-nodes needs two alive nodes; the cluster has {len(nodes)}")
    print(f"holder on {nodes[0]['NodeManagerAddress']}, receiver on {nodes[1]['NodeManagerAddress']}", flush=True)
    return tuple({"scheduling_strategy": NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)} for n in nodes[:2])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path)
    p.add_argument("--address", help="a running cluster's address (e.g. auto) instead of a new one-node cluster")
    p.add_argument("--across-nodes", action="store_true", help="the two actors on two different nodes")
    args = p.parse_args()
    env = announce()

    from ray.experimental.collective import create_collective_group

    ifname = {k: v for k, v in os.environ.items() if k == "GLOO_SOCKET_IFNAME"}
    if args.address:
        ray.init(address=args.address, logging_level="ERROR", runtime_env={"env_vars": ifname})
    else:
        ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": ifname})
    try:
        holder_options, receiver_options = placements(args.across_nodes)
        holder = PageActor.options(**holder_options).remote(0)
        receiver = PageActor.options(**receiver_options).remote(max(args.blocks))
        create_collective_group([holder, receiver], backend="torch_gloo")
        rows = []
        for n in args.blocks:
            store = timed(holder, receiver, "pages", n, args.repeats)
            direct = timed(holder, receiver, "pages_direct", n, args.repeats)
            rows.append({"blocks": n, "mib": n * BLOCK_BYTES / 2**20, "object_store_ms": 1000 * store,
                         "gloo_ms": 1000 * direct})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        ray.shutdown()
    print("\n| blocks | MiB | object store (ms) | GiB/s | gloo direct (ms) | GiB/s | gloo / object store |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        store, gloo, gib = r["object_store_ms"], r["gloo_ms"], r["mib"] / 1024
        print(f"| {r['blocks']} | {r['mib']:.1f} | {store:.1f} | {gib / store * 1000:.2f} | {gloo:.1f} | "
              f"{gib / gloo * 1000:.2f} | {gloo / store:.2f}x |")
    if args.out:
        args.out.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
