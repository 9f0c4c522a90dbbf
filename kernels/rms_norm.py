"""RMSNorm. Torch reference (also the CPU path)."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32.

    x: [T, H] any float dtype; weight: [H]. Returns [T, H] in x's dtype. The cast back to x's
    dtype before the weight multiply matches HF Llama, so bf16 outputs agree bit for bit.
    """
    x32 = x.float()
    var = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(var + eps)).to(x.dtype)
