"""The workers' copy of the running sequences' block tables, on their device, kept current from each step's
updates."""

from __future__ import annotations

import itertools

import torch

from pagedserve.workers.tensors import grown


def table_entries(updates: list[tuple[int, int, list[int]]]) -> tuple[list[int], list[int], list[int],
                                                                         tuple[int, int]]:
    """The entries that `StepBatch.table_updates` (slot, start, block ids) write: their slots, columns and
    block ids, and the (slots, blocks) the table must cover to hold them ((0, 0) for none)."""
    slots = list(itertools.chain.from_iterable(itertools.repeat(slot, len(ids)) for slot, _, ids in updates))
    cols = list(itertools.chain.from_iterable(range(start, start + len(ids)) for _, start, ids in updates))
    ids = list(itertools.chain.from_iterable(ids for _, _, ids in updates))
    shape = ((max(slot for slot, _, _ in updates) + 1, max(start + len(ids) for _, start, ids in updates))
             if updates else (0, 0))
    return slots, cols, ids, shape


class BlockTables:
    """A row per slot (`StepBatch.slots`), on the device the attention kernels read it from, growing as
    slots and tables do. A step writes the entries its `StepBatch.table_updates` changed and gathers its
    rows there, so the host sends the device only those entries: a decode step adds one block to a
    sequence every `block_size` tokens, where its whole table is context_len / block_size entries.

    Every write and read is queued on the device's stream, in step order: a step's gathered rows are
    its own tensor, which later steps' writes do not reach."""

    def __init__(self, device: torch.device) -> None:
        self.table = torch.zeros((0, 0), dtype=torch.long, device=device)  # [slots, blocks]; stale entries: block 0

    @torch.inference_mode()  # the table is one tensor whether a step or a benchmark touches it first
    def write(self, shape: tuple[int, int], slots: torch.Tensor, cols: torch.Tensor, ids: torch.Tensor) -> None:
        """Set entry (slots[i], cols[i]) to ids[i] (tensors on the table's device), the table first grown
        to cover `shape` (see `table_entries`)."""
        self.table = grown(self.table, shape)
        if ids.numel():
            self.table[slots, cols] = ids

    @torch.inference_mode()
    def rows(self, slots: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """The first `shape[1]` entries of each of `slots`' rows (a tensor on the table's device, all below
        `shape[0]`): [len(slots), shape[1]], a new tensor."""
        self.table = grown(self.table, shape)
        return self.table[slots, :shape[1]]
