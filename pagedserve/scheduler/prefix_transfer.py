"""K/V moved between model replicas, the scheduler's side: plain data.

A replica that holds a prompt's prefix *exports* it: the next step reads the cached full blocks (from the pool or
the second tier) into host memory on every rank, each rank its own heads, and the engine hands out each rank's
pages (`PrefixExport`). A replica that lacks them *imports* them: its workers stage each rank's pages first (off the
step loop, `Executor.stage_import`), then the request is queued with a `PrefixImport`, and when it is admitted its
prefix lookup finds those blocks after the pool and the second tier: each is allocated a block, filed in the prefix
cache at once (as a block restored from the second tier is), and the step copies the page in before its forward.
Both copies ride on steps, so the workers do them in step order: a block exported is read after every step that
wrote it, and one imported is written before any step reads it.

The workers hold an import's staged pages until a step releases it: the step that admits its request, or, where the
request never runs (aborted, refused, a beam search), the next one. A failed step may leave any of them behind, so
after one every import not confirmed released is released again (`reset`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PrefixExport:
    """A prompt's cached full blocks [first_block, first_block + len(hashes)), read out of a replica's KV pool.
    `pages[r]` is tensor-parallel rank r's: one tensor per KV pool it holds (the model's, a draft model's), each
    [len(hashes), layers, 2, block_size, kv_heads of the rank, head_dim], or a Ray reference to that list."""

    first_block: int
    hashes: tuple[int, ...]  # each block's chained hash, as the prefix cache files it
    pages: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class PrefixImport:
    """An export staged on this replica's workers under `import_id`, for one request's prefix lookup."""

    import_id: int
    first_block: int
    hashes: tuple[int, ...]

    def page(self, block_index: int, block_hash: int) -> int | None:
        """The staged page holding the prompt's block `block_index`, if it holds it under `block_hash`."""
        k = block_index - self.first_block
        return k if 0 <= k < len(self.hashes) and self.hashes[k] == block_hash else None


@dataclass(frozen=True)
class ExportOrder:
    """An export asked for: up to `num_blocks` of the prompt's full blocks from `first_block` on, where the chain
    starts at `root` (`block_manager.chain_root`)."""

    token_ids: tuple[int, ...]
    root: int | None
    first_block: int
    num_blocks: int


class Transfers:
    """The transfers the next steps carry: exports to read, imports to copy in and to release."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.orders: dict[int, ExportOrder] = {}  # export id -> what to read, in the next step
        self.sent: dict[int, tuple[int, tuple[int, ...]]] = {}  # export id -> (first block, hashes), read by a step
        self.staged: set[int] = set()  # imports whose pages the workers may hold: not confirmed released
        self._releases: list[int] = []  # imports the next step releases

    def next_id(self) -> int:
        return next(self._ids)

    def order_export(self, order: ExportOrder) -> int:
        export_id = self.next_id()
        self.orders[export_id] = order
        return export_id

    def begin_import(self) -> int:
        """An id for pages about to be staged; from here on the workers may hold them."""
        import_id = self.next_id()
        self.staged.add(import_id)
        return import_id

    def release(self, import_id: int) -> None:
        """The next step releases the import's pages (after the copies it makes from them)."""
        if import_id in self.staged and import_id not in self._releases:
            self._releases.append(import_id)

    @property
    def has_copies(self) -> bool:
        """Whether the next step has transfers to carry, even without a row to compute."""
        return bool(self.orders or self._releases)

    def take_exports(self, lookup: Callable[[ExportOrder], tuple[list[int], list[int]]]
                     ) -> list[tuple[int, list[int]]]:
        """The next step's exports, (export id, blocks, -1 - the second tier's slot where it holds one), looked up
        now, after the step's allocations (`BlockManager.export_blocks`): the step reads them before anything
        writes a block. What each holds is kept for the engine (`sent`)."""
        exports = []
        for export_id, order in self.orders.items():
            hashes, blocks = lookup(order)
            exports.append((export_id, blocks))
            self.sent[export_id] = (order.first_block, tuple(hashes))
        self.orders = {}
        return exports

    def take_releases(self) -> list[int]:
        releases, self._releases = self._releases, []
        return releases

    def confirm(self, released: list[int]) -> None:
        """A step that released these ran: the workers hold them no more."""
        self.staged.difference_update(released)

    def reset(self) -> None:
        """After a failed step (or new workers): release every import again; a worker drops what it holds of them."""
        self._releases = sorted(self.staged)

    def fail_exports(self) -> list[int]:
        """A step failed: the exports ordered or read are forgotten, and returned (none of them is sure to be whole)."""
        failed = list(self.orders) + list(self.sent)
        self.orders, self.sent = {}, {}
        return failed
