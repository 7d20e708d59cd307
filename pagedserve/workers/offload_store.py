"""The prefix cache's second tier on a worker: `num_slots` blocks of each KV pool it serves (the model's, and a
draft model's), in pinned host memory beside a CUDA pool or in a file on local disk, each slot with the hash it
was saved under. `scheduler/offload_tier.py` is its index; a step's `kv_saves` and `kv_loads` say what to copy."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from pagedserve.cache_dir import cache_root
from pagedserve.workers.tensors import on_device

MEDIA = ("memory", "disk")


def offload_dir(directory: str | None) -> Path:
    """Where a disk tier's files go, made if missing: `directory`, else the cache directory's `kv-offload`."""
    folder = Path(directory).expanduser() if directory else cache_root() / "kv-offload"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class OffloadStore:
    def __init__(self, pools: list[torch.Tensor], num_slots: int, medium: str, directory: str | None = None) -> None:
        if medium not in MEDIA:
            raise ValueError(f"KV offload medium {medium!r} must be one of {MEDIA}")
        self.pools = pools  # each [layers, 2, N, B, Hkv, D]
        self.medium = medium
        # One per pool: [num_slots, layers, 2, B, Hkv, D], a slot's bytes together
        self.stores = [self._allocate(pool, num_slots, directory) for pool in pools]
        self.hashes: list[int | None] = [None] * num_slots

    def _allocate(self, pool: torch.Tensor, num_slots: int, directory: str | None) -> torch.Tensor:
        shape = (num_slots, pool.shape[0], pool.shape[1], *pool.shape[3:])
        if self.medium == "memory":
            return torch.empty(shape, dtype=pool.dtype, pin_memory=pool.device.type == "cuda")
        folder = offload_dir(directory)
        fd, path = tempfile.mkstemp(prefix="kv-", suffix=".bin", dir=folder)
        try:
            numel = num_slots * pool[:, :, 0].numel()
            # The disk reserved now: a mapped file that meets a full disk when a page is written back kills the
            # process (SIGBUS); this fails at start instead.
            try:
                os.posix_fallocate(fd, 0, numel * pool.element_size())
            except OSError as e:
                raise ValueError(f"kv_offload_disk: {numel * pool.element_size()} bytes in {folder} could not be "
                                 f"reserved ({e.strerror})") from None
            store = torch.from_file(path, shared=True, size=numel, dtype=pool.dtype)
        finally:
            os.close(fd)
            os.unlink(path)  # the mapping keeps the file's blocks; nothing is left on disk when the process ends
        return store.view(shape)

    def save(self, saves: list[tuple[int, int, int]]) -> None:
        """(block, slot, hash): each block's K/V into its slot, in every pool."""
        if not saves:
            return
        blocks = on_device(self.pools[0].device, [b for b, _, _ in saves])  # [n]
        slots = [s for _, s, _ in saves]
        for pool, store in zip(self.pools, self.stores, strict=True):
            kept = pool[:, :, blocks].movedim(2, 0)  # [n, layers, 2, B, Hkv, D]
            if pool.device.type == "cpu":
                store[slots] = kept
            else:  # one copy per slot into pinned memory: asynchronous, in the step's stream order
                kept = kept.contiguous()
                for i, slot in enumerate(slots):
                    store[slot].copy_(kept[i], non_blocking=True)
        for _, slot, block_hash in saves:
            self.hashes[slot] = block_hash

    def load(self, loads: list[tuple[int, int, int]]) -> None:
        """(slot, block, hash): each slot's K/V into its block, in every pool, once the slot is checked to hold
        the hash it is loaded for."""
        if not loads:
            return
        for slot, block, block_hash in loads:
            if self.hashes[slot] != block_hash:
                raise RuntimeError(f"KV offload slot {slot} holds the block of hash {self.hashes[slot]}, not "
                                   f"{block_hash} the step restores into block {block}")
        blocks = on_device(self.pools[0].device, [b for _, b, _ in loads])  # [n]
        slots = [s for s, _, _ in loads]
        for pool, store in zip(self.pools, self.stores, strict=True):
            if pool.device.type == "cpu":
                pool[:, :, blocks] = store[slots].movedim(0, 2)
            else:
                staged = torch.empty((len(slots), *store.shape[1:]), dtype=pool.dtype, device=pool.device)
                for i, slot in enumerate(slots):
                    staged[i].copy_(store[slot], non_blocking=True)
                pool[:, :, blocks] = staged.movedim(0, 2)
