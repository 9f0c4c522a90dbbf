"""Every held sequence's block table, kept on the device and updated by what changed.

A stage's steps name the same sequences over and over, each with a block table that only
grows (a decode adds a block every `block_size` tokens). Rebuilding and uploading all of
them every step cost more host time than a small model's whole decode step on a fast card.
`BlockTables` keeps one row per sequence in a device tensor and, per step, writes only the
entries the host has not written yet: one small upload and one scatter.

The table is a cache of the host's block tables (`SeqChunk.block_table`), never the truth:
a sequence's row is found by its id and is trusted only while the chunk carries the *same
list object* it was filled from, which its owner only appends to (`HeldSeq.block_table`).
Any other list (a new sequence under a reused id, a caller building lists per step) is
written in full. Rows of sequences not in the current step are reused when the table is
full, so correctness never depends on being told that a sequence ended.

Layout: `table` [rows + 1, max_blocks] int32; the last row is the padding row, every entry
`fill` (a block no sequence owns), which CUDA-graph padding rows read.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from stage_worker.host_transfer import upload


class SeqChunk(Protocol):
    """What `rows_for` reads of a step's chunk (`step_input.SeqChunk`)."""

    @property
    def seq_id(self) -> int: ...
    @property
    def num_computed(self) -> int: ...
    @property
    def num_new(self) -> int: ...
    @property
    def block_table(self) -> Sequence[int]: ...


@dataclass
class _Row:
    index: int
    source: Sequence[int]  # the host list the row was filled from
    synced: int  # entries of `source` already on the device
    last_step: int


class BlockTables:
    """Device-resident block tables for up to `rows` sequences of `max_blocks` blocks.

    Args:
        rows: sequences kept at once without reusing rows (a step may name at most this many).
        max_blocks: the widest block table (longest context / block size).
        block_size: tokens per KV block.
        fill: the value of entries no sequence wrote (and of the padding row).
        num_blocks: the KV pool's size, when known: a block id outside [0, num_blocks) is
            refused before it is written (it would make a kernel read or write outside
            the pool).
    """

    def __init__(self, rows: int, max_blocks: int, block_size: int, device: torch.device,
                 fill: int = -1, num_blocks: int | None = None) -> None:
        if rows < 1 or max_blocks < 1:
            raise ValueError(f"block tables need rows and columns, got {rows} x {max_blocks}")
        self.rows = rows
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.device = device
        self.table = torch.full((rows + 1, max_blocks), fill, dtype=torch.int32, device=device)
        self.padding_row = rows
        self.num_blocks = num_blocks
        self._by_seq: dict[int, _Row] = {}
        self._free = list(range(rows - 1, -1, -1))
        self._step = 0

    def rows_for(self, chunks: Sequence[SeqChunk]) -> array[int]:
        """The table row of every chunk's sequence (chunk order), after queueing the writes
        that bring those rows up to date on the device (stream-ordered before any later
        kernel that reads them).

        Raises ValueError when a chunk's block table cannot hold its tokens, is wider than
        `max_blocks`, names a block outside the pool, or the step names more sequences than
        there are rows.
        """
        if len(chunks) > self.rows:
            raise ValueError(f"a step of {len(chunks)} sequences exceeds the {self.rows} "
                             "block-table rows")
        self._step += 1
        step, by_seq, width, size = self._step, self._by_seq, self.max_blocks, self.block_size
        rows: array[int] = array("q")
        index: array[int] = array("q")
        values: array[int] = array("q")
        synced: list[tuple[_Row, int]] = []  # applied once the whole step passed its checks
        for c in chunks:
            table = c.block_table
            n = len(table)
            if n * size < c.num_computed + c.num_new:
                raise ValueError(f"sequence {c.seq_id}: {n} blocks cannot hold "
                                 f"{c.num_computed + c.num_new} tokens (block size {size})")
            row = by_seq.get(c.seq_id)
            if row is None or row.source is not table:
                if row is None:
                    row = self._claim(c.seq_id, step)
                row.source, row.synced = table, 0
            if n > row.synced:
                if n > width:
                    raise ValueError(f"sequence {c.seq_id}: {n} blocks exceed the "
                                     f"{width}-block table")
                new = table[row.synced:]
                if self.num_blocks is not None and (min(new) < 0
                                                    or max(new) >= self.num_blocks):
                    bad = next(b for b in new if not 0 <= b < self.num_blocks)
                    raise ValueError(f"sequence {c.seq_id}: block id {bad} is outside the KV "
                                     f"pool [0, {self.num_blocks})")
                base = row.index * width
                index.extend(range(base + row.synced, base + n))
                values.extend(new)
                synced.append((row, n))
            row.last_step = step
            rows.append(row.index)
        for row, n in synced:
            row.synced = n
        if index:
            self._write(index, values)
        return rows

    def clear(self) -> None:
        """Forget every row (their device entries stay until rewritten)."""
        self._by_seq.clear()
        self._free = list(range(self.rows - 1, -1, -1))

    def _claim(self, seq_id: int, step: int) -> _Row:
        if not self._free:  # full: reuse the row used longest ago (not by this step)
            victim = min(self._by_seq, key=lambda s: self._by_seq[s].last_step)
            if self._by_seq[victim].last_step == step:
                raise AssertionError("rows_for checked the step fits")
            self._free.append(self._by_seq.pop(victim).index)
        row = _Row(self._free.pop(), (), 0, step)
        self._by_seq[seq_id] = row
        return row

    def _write(self, index: array[Any], values: array[Any]) -> None:
        """table.flat[index] = values, from one upload of both."""
        n = len(index)
        index.extend(values)
        packed = upload(torch.frombuffer(index, dtype=torch.int64), self.device)
        self.table.view(-1).index_copy_(0, packed[:n], packed[n:].to(torch.int32))
