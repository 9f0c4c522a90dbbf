"""SiLU-and-multiply of a merged gate/up projection: the Triton kernel on CUDA
(`kernels.elementwise_triton`), the torch reference (also the CPU path and the oracle)
elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.platform import PLATFORM


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul_ref`'s contract; the Triton kernel where the platform uses Triton and
    the input is a CUDA tensor with contiguous rows."""
    if (PLATFORM.use_triton and gate_up.is_cuda and gate_up.dim() == 2
            and gate_up.stride(1) == 1):
        from kernels.elementwise_triton import silu_and_mul_triton

        return silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(gate_up)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2*I] laid out [gate | up]; returns silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
