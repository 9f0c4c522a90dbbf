"""One step's work for a stage, as domain objects, and the tensors built from it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.paged_attention import PagedAttentionMetadata
from kernels.rotary import rope_cos_sin
from stage_worker.forward_context import ForwardContext


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step.

    num_computed: tokens of the sequence already in this stage's KV cache
    num_new:      tokens computed this step (a prefill chunk, or 1 for a decode)
    block_table:  the sequence's block ids, covering at least num_computed + num_new slots
    sample:       whether the last stage samples a token from this chunk's last position
    """

    seq_id: int
    num_computed: int
    num_new: int
    block_table: Sequence[int]
    sample: bool = True


def build_context(chunks: Sequence[SeqChunk], block_size: int, inv_freq: torch.Tensor,
                  device: torch.device) -> ForwardContext:
    """Positions, rope tables, KV slots and attention layout for `chunks`, on `device`.

    Raises ValueError when a block table is too short for its chunk.
    """
    max_blocks = max(len(c.block_table) for c in chunks)
    table_rows, seq_lens, q_lens = [], [], []
    for c in chunks:
        total = c.num_computed + c.num_new
        if len(c.block_table) * block_size < total:
            raise ValueError(f"sequence {c.seq_id}: {len(c.block_table)} blocks cannot hold "
                             f"{total} tokens (block size {block_size})")
        table_rows.append(list(c.block_table) + [-1] * (max_blocks - len(c.block_table)))
        seq_lens.append(total)
        q_lens.append(c.num_new)
    block_tables = torch.tensor(table_rows, dtype=torch.int32)
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
    query_start = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    torch.cumsum(q_lens_t, 0, out=query_start[1:])
    # Token t belongs to sequence seq_of[t] and sits at position seq_len - q_len + offset.
    seq_of = torch.repeat_interleave(torch.arange(len(chunks)), q_lens_t)
    offset = torch.arange(int(query_start[-1])) - query_start[seq_of]
    positions = (seq_lens_t - q_lens_t)[seq_of] + offset
    slots = block_tables[seq_of, positions // block_size].long() * block_size \
        + positions % block_size
    cos, sin = rope_cos_sin(inv_freq, positions)
    decode_seqs = tuple(i for i, n in enumerate(q_lens) if n == 1)
    prefill_seqs = tuple(i for i, n in enumerate(q_lens) if n != 1)
    decode_rows = (torch.tensor([int(query_start[i]) for i in decode_seqs], device=device)
                   if decode_seqs and prefill_seqs else None)
    attn = PagedAttentionMetadata(
        block_tables=block_tables.to(device),
        seq_lens=seq_lens_t.to(device=device, dtype=torch.int32),
        query_start=query_start.to(device=device, dtype=torch.int32),
        seq_lens_host=tuple(seq_lens),
        query_start_host=tuple(int(x) for x in query_start),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        decode_seqs=decode_seqs if prefill_seqs else (),
        decode_rows=decode_rows,
        decode_index=(torch.tensor(decode_seqs, device=device) if decode_rows is not None
                      else None),
        prefill_seqs=prefill_seqs,
    )
    return ForwardContext(positions.to(device), cos.to(device), sin.to(device),
                          slots.to(device), attn)


def sample_rows(chunks: Sequence[SeqChunk]) -> list[int]:
    """Row index (in the step's token order) of the last token of every sampling chunk."""
    rows, end = [], 0
    for c in chunks:
        end += c.num_new
        if c.sample:
            rows.append(end - 1)
    return rows
