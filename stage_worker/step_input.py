"""One step's work for a stage, as domain objects, and the tensors built from it.

`build_context` computes a step's layout on the host (counts in Python, per-token values
with a few CPU tensor ops), packs every integer array into one int64 tensor, uploads it
once without blocking (`host_transfer.upload`), and derives the rope tables, the block
tables (`BlockTables`, kept on the device) and the KV slots on the device from the uploaded
rows and positions. The host never waits for the GPU here.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import accumulate
from typing import NamedTuple

import torch

from kernels.paged_attention import PagedAttentionMetadata
from kernels.rotary import rope_cos_sin
from stage_worker.block_tables import BlockTables
from stage_worker.forward_context import ForwardContext
from stage_worker.host_transfer import host_tensor, upload


class SeqChunk(NamedTuple):
    """One sequence's share of a step (a NamedTuple: a step builds hundreds of them).

    num_computed: tokens of the sequence already in this stage's KV cache
    num_new:      tokens computed this step (a prefill chunk, or 1 for a decode)
    block_table:  the sequence's block ids, covering at least num_computed + num_new slots
                  (a stage passes its held sequence's own list: read it during the step
                  that built the chunk, never keep it)
    sample:       whether the last stage samples a token from this chunk's last position
    prompt_rows:  last stage: how many leading rows of the chunk score the next prompt token
                  (prompt log probabilities asked; 0 otherwise)
    """

    seq_id: int
    num_computed: int
    num_new: int
    block_table: Sequence[int]
    sample: bool = True
    prompt_rows: int = 0


class _HostLayout(NamedTuple):
    """A step's layout on the host: the lists the reference attention reads and the
    integer tensors (CPU) to upload."""

    seq_lens: list[int]
    query_start: list[int]
    max_query_len: int
    decode_seqs: tuple[int, ...]
    prefill_seqs: tuple[int, ...]
    arrays: list[torch.Tensor]  # table rows [S], seq_lens, query_start, positions, seq_of
    #                             [T], then (mixed steps) decode rows and decode indices; int64


def build_context(chunks: Sequence[SeqChunk], tables: BlockTables, inv_freq: torch.Tensor,
                  device: torch.device) -> ForwardContext:
    """Positions, rope tables, KV slots and attention layout for `chunks`, on `device`.

    The chunks' block tables come from `tables` (brought up to date for them here);
    `inv_freq` [head_dim / 2] should live on `device` (rope is computed there).
    Raises ValueError when a block table is too short for its chunk.
    """
    block_size = tables.block_size
    host = _host_layout(chunks, tables.rows_for(chunks))
    packed = upload(torch.cat([a.reshape(-1) for a in host.arrays]), device)
    rows, seq_lens, query_start, positions, seq_of, *decode = packed.split(
        [a.numel() for a in host.arrays])
    width = -(-max(host.seq_lens) // block_size)  # the blocks this step reads
    block_tables = tables.table[rows, :width]
    slots = (block_tables[seq_of, positions // block_size].long() * block_size
             + positions % block_size)
    cos, sin = rope_cos_sin(inv_freq, positions)
    attn = PagedAttentionMetadata(
        block_tables=block_tables,
        seq_lens=seq_lens.to(torch.int32),
        query_start=query_start.to(torch.int32),
        seq_lens_host=tuple(host.seq_lens),
        query_start_host=tuple(host.query_start),
        max_query_len=host.max_query_len,
        max_seq_len=max(host.seq_lens),
        decode_seqs=host.decode_seqs if host.prefill_seqs else (),
        decode_rows=decode[0] if decode else None,
        decode_index=decode[1] if decode else None,
        prefill_seqs=host.prefill_seqs,
    )
    return ForwardContext(positions, cos, sin, slots, attn)


def _host_layout(chunks: Sequence[SeqChunk], rows: array[int]) -> _HostLayout:
    """Token t of the step belongs to chunk seq_of[t] and sits at position
    seq_len - q_len + offset (its KV slot is computed on the device from the table row)."""
    q_lens = [c.num_new for c in chunks]
    seq_lens = [c.num_computed + c.num_new for c in chunks]
    query_start = [0, *accumulate(q_lens)]
    lens = host_tensor(seq_lens)
    max_query_len = max(q_lens)
    if max_query_len == 1:  # all decodes: one token per sequence, at its last position
        seq_of, positions = torch.arange(len(chunks)), lens - 1
    else:
        seq_of = torch.repeat_interleave(torch.arange(len(chunks)), host_tensor(q_lens))
        offset = torch.arange(query_start[-1]) - host_tensor(query_start[:-1])[seq_of]
        positions = (lens - host_tensor(q_lens))[seq_of] + offset
    decode_seqs = tuple(i for i, n in enumerate(q_lens) if n == 1)
    prefill_seqs = tuple(i for i, n in enumerate(q_lens) if n != 1)
    arrays = [torch.frombuffer(rows, dtype=torch.int64), lens, host_tensor(query_start),
              positions, seq_of]
    if decode_seqs and prefill_seqs:
        arrays += [host_tensor(query_start[i] for i in decode_seqs), host_tensor(decode_seqs)]
    return _HostLayout(seq_lens, query_start, max_query_len, decode_seqs, prefill_seqs, arrays)


def score_rows(chunks: Sequence[SeqChunk]) -> tuple[list[int], int]:
    """The rows (indices in the step's token order) the last stage computes logits for, and
    how many of them score prompt tokens: the last row of every sampling chunk, then every
    chunk's `prompt_rows` leading rows, each group in chunk order."""
    rows: list[int] = []
    prompt: list[int] = []
    end = 0
    for c in chunks:
        if c.prompt_rows:
            prompt.extend(range(end, end + c.prompt_rows))
        end += c.num_new
        if c.sample:
            rows.append(end - 1)
    return rows + prompt if prompt else rows, len(prompt)
