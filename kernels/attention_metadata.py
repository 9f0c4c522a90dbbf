"""The layout of one step's paged attention, shared by the torch reference
(`kernels.paged_attention`) and the Triton kernel (`kernels.paged_attention_triton`): the
contract of both is in `kernels.paged_attention`'s docstring."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """One step's attention layout. Host lists feed the reference; tensors feed kernels."""

    block_tables: torch.Tensor  # [S, M] int32; entries past a sequence's blocks are never read
    seq_lens: torch.Tensor  # [S] int32
    query_start: torch.Tensor  # [S + 1] int32
    seq_lens_host: tuple[int, ...]
    query_start_host: tuple[int, ...]
    max_query_len: int
    max_seq_len: int
    # Mixed batches: the decode sequences (one query row each) go through one batched call.
    decode_seqs: tuple[int, ...] = ()  # indices of sequences with a single query row
    decode_rows: torch.Tensor | None = None  # [D] q row of each, on the device
    decode_index: torch.Tensor | None = None  # [D] decode_seqs as a device tensor
    prefill_seqs: tuple[int, ...] = ()  # the others, attended one by one

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
