"""RMSNorm layer (replicated on every TP rank)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.rms_norm import add_rms_norm, rms_norm
from stage_worker.layers.weights import WeightSource, copy_checked


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual) in one pass where a fused kernel runs."""
        return add_rms_norm(x, residual, self.weight, self.eps)

    def load(self, name: str, src: WeightSource, shard: str | int | None = None) -> None:
        copy_checked(self.weight, src[:], name)
