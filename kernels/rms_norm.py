"""RMSNorm, and the residual add fused with it: the Triton kernels on CUDA
(`kernels.elementwise_triton`), the torch references (also the CPU path and the oracle)
elsewhere."""

from __future__ import annotations

import torch

from kernels.platform import PLATFORM


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_ref`'s contract; the Triton kernel where the platform uses Triton and x is a
    CUDA tensor with contiguous rows."""
    if PLATFORM.use_triton and x.is_cuda and x.dim() == 2 and x.stride(1) == 1:
        from kernels.elementwise_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32.

    x: [T, H] any float dtype; weight: [H]. Returns [T, H] in x's dtype. The cast back to x's
    dtype before the weight multiply matches HF Llama, so bf16 outputs agree bit for bit.
    """
    x32 = x.float()
    var = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(var + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_ref`'s contract; one Triton kernel where the platform uses Triton and
    both inputs are CUDA tensors with contiguous rows."""
    if (PLATFORM.use_triton and x.is_cuda and x.dim() == 2 and x.stride(1) == 1
            and residual.stride(1) == 1 and residual.dtype == x.dtype):
        from kernels.elementwise_triton import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_ref(x + residual), x + residual): a decoder layer's residual add and the norm
    that reads its result. x, residual [T, H] of one dtype; the sum is rounded to that dtype
    before the norm reads it, exactly as the two ops apart."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed
