"""The workers' block tables, kept from each step's updates (the scheduler's side: test_scheduler.py)."""

from __future__ import annotations

import torch

from pagedserve.workers.block_tables import BlockTables


def test_updates_write_from_their_start_and_the_table_grows():
    tables = BlockTables()
    tables.update([(0, 0, [5, 6]), (3, 0, [7])])
    assert tables.rows([3, 0], 2).tolist() == [[7, 0], [5, 6]]  # slot 3's second entry was never written
    tables.update([(0, 2, [8, 9, 10])])  # wider than the table: it grows and keeps what it held
    assert tables.rows([0], 5).tolist() == [[5, 6, 8, 9, 10]]
    tables.update([(0, 1, [11, 8])])  # copy-on-write rewrote entry 1
    assert tables.rows([0, 3], 3).tolist() == [[5, 11, 8], [7, 0, 0]]
    tables.update([(20, 0, [1])])  # a new slot past the last row
    assert tables.rows([20, 3, 0], 1).tolist() == [[1], [7], [5]]


def test_a_steps_rows_do_not_change_with_later_updates():
    # On CUDA the rows are copied to the device without waiting; the next step's updates must not reach them.
    tables = BlockTables()
    tables.update([(0, 0, [1, 2])])
    rows = tables.rows([0], 2)
    tables.update([(0, 0, [3, 4])])
    assert rows.tolist() == [[1, 2]]
    assert tables.rows([0], 2).tolist() == [[3, 4]]


def test_inside_and_outside_inference_mode():
    # Steps run under torch.inference_mode, which makes what it creates read-only outside it.
    tables = BlockTables()
    with torch.inference_mode():
        tables.update([(0, 0, [1]), (1, 0, [3])])
    tables.update([(1, 0, [2])])  # in place: the table need not grow
    assert tables.rows([1, 0], 1).tolist() == [[2], [1]]
