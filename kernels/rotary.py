"""Rotary position embedding (rotate-half layout, as HF Llama). Torch reference."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(
    head_dim: int,
    theta: float,
    llama3: tuple[float, float, float, int] | None = None,
) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], fp32, optionally with llama3 frequency scaling.

    llama3 = (factor, low_freq_factor, high_freq_factor, original_max_positions): long
    wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if llama3 is None:
        return inv_freq
    factor, low, high, old_ctx = llama3
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """cos, sin of shape [T, head_dim] (halves duplicated) for int positions [T], fp32."""
    freqs = positions.float()[:, None] * inv_freq[None, :].to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] fp32. Returns rotated x, x's dtype."""
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
