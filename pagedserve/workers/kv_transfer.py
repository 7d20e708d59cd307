"""K/V moved between model replicas, a worker's side (`scheduler/prefix_transfer.py` is the scheduler's): blocks of
its KV pools read into host memory for another replica (an export), and pages another replica exported, staged here
until a step copies them into blocks (an import). Each rank moves its own heads: rank r's pages go to rank r.

Staging runs off the step loop (a Ray actor's call of its own), so it takes a lock against the steps that copy and
release; an import released before its pages arrived (a transfer given up while they were on the way) drops them
when they come."""

from __future__ import annotations

import threading

import torch

from pagedserve.workers.offload_store import OffloadStore
from pagedserve.workers.tensors import on_device

# Imports released before their pages came that are remembered: far more than are ever on the way at once.
_EARLY_KEPT = 1024


class KVTransfer:
    def __init__(self, pools: list[torch.Tensor], offload: OffloadStore | None = None) -> None:
        self.pools = pools  # each [layers, 2, N, B, Hkv, D]: the model's, and a draft model's
        self.offload = offload  # the second tier, which an export may read a block from
        self._lock = threading.Lock()
        self._staged: dict[int, list[torch.Tensor]] = {}  # import id -> per pool [pages, layers, 2, B, Hkv, D]
        self._released_early: dict[int, None] = {}  # the latest `_EARLY_KEPT`, oldest first
        self._exports: dict[int, list[torch.Tensor]] = {}  # export id -> per pool [blocks, layers, 2, B, Hkv, D]

    def page_shapes(self) -> list[tuple[int, ...]]:
        """One page's shape in each pool: [layers, 2, B, Hkv, D]."""
        return [(pool.shape[0], pool.shape[1], *pool.shape[3:]) for pool in self.pools]

    def stage(self, import_id: int, pages: list[torch.Tensor]) -> None:
        """Keep another replica's pages (one tensor per pool, [n, layers, 2, B, Hkv, D]) until a step copies them.
        ValueError where they do not fit this rank's pools (another model, dtype, block size or head split)."""
        shapes = [tuple(p.shape[1:]) for p in pages]
        dtypes = [p.dtype for p in pages]
        if shapes != self.page_shapes() or dtypes != [pool.dtype for pool in self.pools]:
            raise ValueError(f"the K/V pages fetched have shapes {shapes} in {dtypes}; this rank's pools hold "
                             f"{self.page_shapes()} in {[pool.dtype for pool in self.pools]}")
        with self._lock:
            if import_id in self._released_early:
                del self._released_early[import_id]
                return
            self._staged[import_id] = pages

    def copy(self, imports: list[tuple[int, int, int]], released: list[int], exports: list[tuple[int, list[int]]]
             ) -> None:
        """A step's transfers, in order: (import id, page, block) copied in, the imports `released` dropped, then
        (export id, blocks) read out (a block -1 - slot: the second tier's slot)."""
        with self._lock:
            for import_id, page, block in imports:
                pages = self._staged.get(import_id)
                if pages is None:
                    raise RuntimeError(f"the step copies page {page} of import {import_id}, which this rank does not "
                                       "hold")
                for pool, staged in zip(self.pools, pages, strict=True):
                    pool[:, :, block] = staged[page].to(pool.device)
            for import_id in released:
                if self._staged.pop(import_id, None) is None:  # it failed to stage, or is still on the way
                    self._released_early[import_id] = None
                    if len(self._released_early) > _EARLY_KEPT:
                        del self._released_early[next(iter(self._released_early))]
        for export_id, blocks in exports:
            self._exports[export_id] = [self._read(p, blocks) for p in range(len(self.pools))]

    def _read(self, p: int, blocks: list[int]) -> torch.Tensor:
        """Pool p's pages of `blocks` (negative: -1 - the second tier's slot), in host memory: [n, layers, 2, B, Hkv,
        D]."""
        pool = self.pools[p]
        if all(b >= 0 for b in blocks):
            return pool[:, :, on_device(pool.device, blocks)].movedim(2, 0).to("cpu").contiguous()
        return torch.stack([pool[:, :, b].to("cpu") if b >= 0 else self.offload.stores[p][-1 - b] for b in blocks])

    def take(self, export_id: int) -> list[torch.Tensor]:
        """An export's pages, which this rank keeps no more. KeyError if no step read it here."""
        return self._exports.pop(export_id)

    @property
    def num_held(self) -> int:
        """Imports staged and exports not taken: what this rank holds for transfers (0 when none is under way)."""
        return len(self._staged) + len(self._exports)
