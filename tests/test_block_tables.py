"""The workers' block tables, kept on their device from each step's updates (the scheduler's side:
test_scheduler.py)."""

from __future__ import annotations

import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.scheduler.batch import StepBatch
from pagedserve.workers.block_tables import BlockTables, table_entries


def update(tables: BlockTables, updates: list[tuple[int, int, list[int]]]) -> None:
    slots, cols, ids, shape = table_entries(updates)
    tables.write(shape, *(torch.tensor(x, dtype=torch.long) for x in (slots, cols, ids)))


def rows(tables: BlockTables, slots: list[int], num_blocks: int) -> list[list[int]]:
    return tables.rows(torch.tensor(slots), (max(slots) + 1, num_blocks)).tolist()


def test_updates_write_from_their_start_and_the_table_grows():
    tables = BlockTables(torch.device("cpu"))
    update(tables, [(0, 0, [5, 6]), (3, 0, [7])])
    assert rows(tables, [3, 0], 2) == [[7, 0], [5, 6]]  # slot 3's second entry was never written
    update(tables, [(0, 2, [8, 9, 10])])  # wider than the table: it grows and keeps what it held
    assert rows(tables, [0], 5) == [[5, 6, 8, 9, 10]]
    update(tables, [(0, 1, [11, 8])])  # copy-on-write rewrote entry 1
    assert rows(tables, [0, 3], 3) == [[5, 11, 8], [7, 0, 0]]
    update(tables, [(20, 0, [1])])  # a new slot past the last row
    assert rows(tables, [20, 3, 0], 1) == [[1], [7], [5]]
    update(tables, [])  # a step that changed no table
    assert rows(tables, [0], 2) == [[5, 11]]
    assert rows(tables, [40], 7) == [[0] * 7]  # reading past the table grows it too


def test_a_steps_rows_do_not_change_with_later_updates():
    # The attention kernels of a step may still be queued when the next step writes the table.
    tables = BlockTables(torch.device("cpu"))
    update(tables, [(0, 0, [1, 2])])
    step_rows = tables.rows(torch.tensor([0]), (1, 2))
    update(tables, [(0, 0, [3, 4])])
    assert step_rows.tolist() == [[1, 2]]
    assert rows(tables, [0], 2) == [[3, 4]]


def test_inside_and_outside_inference_mode():
    # Steps run under torch.inference_mode, which makes what it creates read-only outside it.
    tables = BlockTables(torch.device("cpu"))
    with torch.inference_mode():
        update(tables, [(0, 0, [1]), (1, 0, [3])])
    update(tables, [(1, 0, [2])])  # in place: the table need not grow
    assert rows(tables, [1, 0], 1) == [[2], [1]]


def test_a_decode_step_sends_what_changed_not_whole_tables(tiny_random):
    """What a step copies to the device does not grow with its rows' context: the tables stay there."""
    engine = LLMEngine(EngineConfig(model=tiny_random, kv_cache_memory="4MiB", block_size=16))
    runner = engine.executor.worker.runner
    sent = {}
    for context in (20, 410):
        tables = [list(range(r * 32, r * 32 + -(-context // 16))) for r in range(4)]
        # The step that admitted the four rows wrote their whole tables.
        runner.prepare(StepBatch(input_ids=[0] * (4 * context), cu_seqlens_q=[r * context for r in range(5)],
                                 context_lens=[context] * 4, slots=[0, 1, 2, 3],
                                 table_updates=[[(r, 0, t) for r, t in enumerate(tables)]]))
        # The next one decodes a token for each: position `context`, in the last block of each table.
        inputs = runner.prepare(StepBatch(input_ids=[1, 2, 3, 4], cu_seqlens_q=[0, 1, 2, 3, 4],
                                          context_lens=[context + 1] * 4, slots=[3, 2, 1, 0]))
        assert inputs.ctx.block_tables.tolist() == tables[::-1]
        assert inputs.ctx.slot_mapping.tolist() == [t[context // 16] * 16 + context % 16 for t in tables[::-1]]
        assert inputs.positions.tolist() == [context] * 4
        # On a CPU the step's tensors are views of the one host buffer that CUDA copies to the device.
        sent[context] = inputs.input_ids.untyped_storage().nbytes()
    assert sent[20] == sent[410]
    engine.shutdown()
