"""Vocab-parallel token embedding (first stage) and LM head (last stage).

The vocabulary is padded to a multiple of the TP size; rank r owns rows
[r * Vp/T, (r+1) * Vp/T). Padding rows are zero and their logits are cut off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stage_worker.layers.weights import WeightSource, copy_checked
from stage_worker.parallel import TPGroup


def _vocab_shard(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    padded = -(-vocab_size // tp.size) * tp.size
    per = padded // tp.size
    return padded, tp.rank * per, (tp.rank + 1) * per


class _VocabShard(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.padded, self.start, self.end = _vocab_shard(vocab_size, tp)
        self.weight = nn.Parameter(torch.zeros(self.end - self.start, hidden, dtype=dtype),
                                   requires_grad=False)

    def load(self, name: str, src: WeightSource, shard: str | int | None = None) -> None:
        # Rows past the real vocabulary (padding) stay zero.
        real_end = min(self.end, self.vocab_size)
        if real_end > self.start:
            copy_checked(self.weight[:real_end - self.start], src[self.start:real_end], name)


class VocabParallelEmbedding(_VocabShard):
    """ids [T] -> [T, H]: each rank looks up the ids it owns, the rest are summed in."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(_VocabShard):
    """[S, H] -> logits [S, V], gathered across the TP group (every rank gets them all)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[:, :self.vocab_size]
