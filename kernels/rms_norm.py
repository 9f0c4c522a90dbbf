"""RMSNorm: the Triton kernel on CUDA (`kernels.elementwise_triton`), the torch reference
(also the CPU path and the oracle) elsewhere."""

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
