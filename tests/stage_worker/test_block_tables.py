"""The device block tables: a cache of the host's tables that writes only what changed and
can never serve a stale row."""

from __future__ import annotations

import random

import pytest
import torch

from stage_worker.block_tables import BlockTables
from stage_worker.step_input import SeqChunk

CPU = torch.device("cpu")


class CountingTables(BlockTables):
    """Counts the entries written to the device."""

    written = 0

    def _write(self, index, values):  # type: ignore[no-untyped-def]
        self.written += len(index)
        super()._write(index, values)


def table_of(tables: BlockTables, row: int, n: int) -> list[int]:
    return tables.table[row, :n].tolist()


def test_a_growing_table_writes_only_its_new_blocks() -> None:
    tables = CountingTables(4, 8, 16, CPU)
    blocks = [7, 3]
    (row,) = tables.rows_for([SeqChunk(5, 0, 20, blocks)])
    assert tables.written == 2 and table_of(tables, row, 2) == [7, 3]
    for step in range(3):  # decodes within the blocks it has: nothing to write
        assert tables.rows_for([SeqChunk(5, 20 + step, 1, blocks)]).tolist() == [row]
    assert tables.written == 2
    blocks.append(9)  # the owner appends a block
    assert tables.rows_for([SeqChunk(5, 32, 1, blocks)]).tolist() == [row]
    assert tables.written == 3 and table_of(tables, row, 3) == [7, 3, 9]


def test_another_list_under_the_same_id_is_written_in_full() -> None:
    tables = BlockTables(4, 8, 16, CPU)
    (row,) = tables.rows_for([SeqChunk(1, 0, 40, [1, 2, 3])])
    # A new sequence reusing id 1 (its first blocks differ, same length): no stale entry.
    (again,) = tables.rows_for([SeqChunk(1, 0, 40, [4, 5, 6])])
    assert table_of(tables, again, 3) == [4, 5, 6]
    assert again == row


def test_cleared_tables_rewrite_every_sequence_they_see_again() -> None:
    """After the runner's warm-up steps: no row is kept, the same list is written again."""
    tables = CountingTables(2, 4, 16, CPU)
    blocks = [4, 6]
    tables.rows_for([SeqChunk(0, 0, 20, blocks), SeqChunk(1, 0, 1, [5])])
    tables.clear()
    (row,) = tables.rows_for([SeqChunk(0, 20, 1, blocks)])
    assert tables.written == 5 and table_of(tables, row, 2) == [4, 6]
    tables.rows_for([SeqChunk(7, 0, 1, [1])])  # both rows free again: nothing reused
    assert tables.rows_for([SeqChunk(0, 21, 1, blocks)]).tolist() == [row]


def test_a_full_table_reuses_the_row_used_longest_ago() -> None:
    tables = BlockTables(2, 4, 16, CPU)
    a, b = [1], [2]
    (row_a,) = tables.rows_for([SeqChunk(0, 0, 1, a)])
    (row_b,) = tables.rows_for([SeqChunk(1, 0, 1, b)])
    tables.rows_for([SeqChunk(0, 1, 1, a)])  # 0 used last; 1 is the oldest
    assert tables.rows_for([SeqChunk(2, 0, 1, [3])]).tolist() == [row_b]
    rows = tables.rows_for([SeqChunk(0, 2, 1, a), SeqChunk(1, 1, 1, b)])  # 1 comes back
    assert rows[0] == row_a and table_of(tables, row_a, 1) == [1]
    assert table_of(tables, rows[1], 1) == [2]  # rewritten in full where 2 was


def test_steps_beyond_the_limits_are_refused() -> None:
    tables = BlockTables(2, 3, 16, CPU)
    with pytest.raises(ValueError, match="3 sequences exceeds the 2 block-table rows"):
        tables.rows_for([SeqChunk(i, 0, 1, [i]) for i in range(3)])
    with pytest.raises(ValueError, match="sequence 4: 1 blocks cannot hold 17 tokens"):
        tables.rows_for([SeqChunk(4, 16, 1, [0])])
    with pytest.raises(ValueError, match="sequence 5: 4 blocks exceed the 3-block table"):
        tables.rows_for([SeqChunk(5, 0, 1, [0, 1, 2, 3])])


def test_a_block_outside_the_pool_never_reaches_the_table() -> None:
    tables = BlockTables(2, 4, 16, CPU, num_blocks=10)
    with pytest.raises(ValueError, match="sequence 3: block id 10 is outside the KV pool "
                                         r"\[0, 10\)"):
        tables.rows_for([SeqChunk(3, 0, 20, [9, 10])])
    with pytest.raises(ValueError, match="block id -1 is outside"):
        tables.rows_for([SeqChunk(4, 0, 1, [-1])])
    blocks = [9]
    (row,) = tables.rows_for([SeqChunk(5, 0, 16, blocks)])
    blocks.append(12)  # an appended block is checked too
    with pytest.raises(ValueError, match="block id 12"):
        tables.rows_for([SeqChunk(5, 16, 1, blocks)])
    assert table_of(tables, row, 1) == [9]


def test_a_refused_step_leaves_no_row_believed_written() -> None:
    tables = BlockTables(4, 4, 16, CPU, num_blocks=10)
    good = [1, 2]
    with pytest.raises(ValueError, match="block id 11"):
        tables.rows_for([SeqChunk(0, 0, 20, good), SeqChunk(1, 0, 1, [11])])
    (row,) = tables.rows_for([SeqChunk(0, 20, 1, good)])  # written now, in full
    assert table_of(tables, row, 2) == [1, 2]


def test_the_padding_row_holds_the_fill_value() -> None:
    tables = BlockTables(3, 4, 16, CPU, fill=99)
    tables.rows_for([SeqChunk(0, 0, 64, [1, 2, 3, 4])])
    assert tables.table[tables.padding_row].tolist() == [99] * 4


def test_random_steps_always_see_their_own_tables() -> None:
    """Sequences come, grow and go (ids reused) over steps of random subsets, with fewer
    rows than sequences: every step's rows hold exactly its chunks' tables."""
    rng = random.Random(3)
    tables = BlockTables(6, 16, 4, CPU)
    live: dict[int, list[int]] = {}
    next_block = 0
    for _ in range(400):
        for seq_id in range(10):
            if seq_id not in live and rng.random() < 0.3:
                live[seq_id] = [next_block]
                next_block += 1
            elif seq_id in live and rng.random() < 0.05:
                del live[seq_id]
        for blocks in live.values():
            if len(blocks) < 16 and rng.random() < 0.3:
                blocks.append(next_block)
                next_block += 1
        step = rng.sample(sorted(live), min(len(live), rng.randint(1, 6))) if live else []
        if not step:
            continue
        chunks = [SeqChunk(s, len(live[s]) * 4 - 1, 1, live[s]) for s in step]
        rows = tables.rows_for(chunks)
        assert len(set(rows)) == len(rows)
        for row, c in zip(rows, chunks, strict=True):
            assert table_of(tables, row, len(c.block_table)) == list(c.block_table)
