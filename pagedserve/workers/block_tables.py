"""The workers' copy of the running sequences' block tables, kept current from each step's updates."""

from __future__ import annotations

import itertools

import torch

from pagedserve.workers.tensors import grown


class BlockTables:
    """A row per slot (`StepBatch.slots`), growing as slots and tables do. Each step applies its
    `StepBatch.table_updates` and reads its rows' tables, so a step carries only the entries that changed:
    most decode steps add one block to a sequence every `block_size` tokens, where a whole table is
    context_len / block_size entries for every row."""

    def __init__(self) -> None:
        self.table = torch.zeros((0, 0), dtype=torch.long)  # [slots, blocks]; stale entries name block 0

    @torch.inference_mode()  # the table is one tensor whether a step or a benchmark touches it first
    def update(self, updates: list[tuple[int, int, list[int]]]) -> None:
        """Write each (slot, start, block ids): the slot's entries from `start` on."""
        if not updates:
            return
        rows = list(itertools.chain.from_iterable(itertools.repeat(slot, len(ids)) for slot, _, ids in updates))
        cols = list(itertools.chain.from_iterable(range(start, start + len(ids)) for _, start, ids in updates))
        self.table = grown(self.table, (max(slot for slot, _, _ in updates) + 1,
                                        max(start + len(ids) for _, start, ids in updates)))
        self.table[rows, cols] = torch.tensor(list(itertools.chain.from_iterable(ids for _, _, ids in updates)),
                                              dtype=torch.long)

    @torch.inference_mode()
    def rows(self, slots: list[int], num_blocks: int) -> torch.Tensor:
        """The first `num_blocks` entries of each slot's table: [len(slots), num_blocks], a new tensor (a
        copy to the device may still be reading it when the next step updates the table)."""
        self.table = grown(self.table, (max(slots) + 1, num_blocks))
        return self.table[torch.tensor(slots, dtype=torch.long), :num_blocks]
