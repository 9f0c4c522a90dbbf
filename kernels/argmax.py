"""The index of each row's largest value (a greedy sampler's pick over the vocabulary): the
Triton kernel on CUDA (`kernels.argmax_triton`), torch's argmax (the reference, also the CPU
path) elsewhere."""

from __future__ import annotations

import torch

from kernels.platform import PLATFORM


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`argmax_rows_ref`'s contract; the Triton kernel where the platform uses Triton and `x`
    is a CUDA tensor with contiguous rows."""
    if (PLATFORM.use_triton and x.is_cuda and x.dim() == 2 and x.shape[1] > 0
            and x.stride(1) == 1):
        from kernels.argmax_triton import argmax_rows_triton

        return argmax_rows_triton(x)
    return argmax_rows_ref(x)


def argmax_rows_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [S, V] floats; returns [S] int64, the first index of each row's largest value (the
    same in any float dtype the values are exactly widened to)."""
    return x.argmax(dim=-1)
