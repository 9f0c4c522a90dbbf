"""Per-step tensors every layer of a stage reads: positions, rope, KV slots, attention layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_attention import PagedAttentionMetadata


@dataclass(frozen=True)
class ForwardContext:
    """Built once per step by the runner; shared by all layers of the stage.

    positions:    [T] int64, absolute position of each new token
    cos, sin:     [T, head_dim] fp32 rope tables for those positions
    slot_mapping: [T] int64, flat KV slot (block * block_size + offset) of each new token
    attn:         the step's attention layout; None in the pieces of a step that run no
                  attention (`stage_worker.mixed_graphs` captures them apart)
    """

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    attn: PagedAttentionMetadata | None
