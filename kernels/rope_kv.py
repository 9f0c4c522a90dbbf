"""Rotary embedding of a step's q and k fused with the paged KV write: the Triton kernel on
CUDA (`kernels.rope_kv_triton`), the torch reference (also the CPU path and the oracle)
elsewhere.

Contract (shared by both):
    q:            [T, Hq, D]      the step's queries; rows may be strided (views of the QKV
    k, v:         [T, Hkv, D]     projection's output), the last dimension contiguous
    cos, sin:     [T, D] fp32     rope tables of each token's position (halves duplicated)
    k/v_cache:    [N, B, Hkv, D]  one layer's pool (`kernels.paged_attention`'s layout), in
                                  q's dtype or float8_e4m3fn (k and v then stored rounded to
                                  nearest even and saturated to +-448: `to_cache_dtype`)
    slot_mapping: [T] int64       flat slot (block * B + offset) of each token, all >= 0
Returns rotated q [T, Hq, D] (contiguous, q's dtype) and writes rotated k and v into the
caches. Rounding is HF Llama's: cos/sin cast to q's dtype, x * cos and rotate_half(x) * sin
each rounded to it, then their sum.

`rope_kv_decode_attention` is this followed by `kernels.paged_attention` for a pure decode
step (every sequence one query row): on CUDA, with the cache in q's dtype, one Triton
launch does both (`kernels.paged_attention_triton.paged_attention_triton` given the new k, v),
elsewhere the two kernels or the two references.
"""

from __future__ import annotations

import torch

from kernels.attention_metadata import PagedAttentionMetadata
from kernels.paged_attention import paged_attention, uses_triton_kernel, write_kv_ref
from kernels.platform import PLATFORM
from kernels.rotary import apply_rope_ref


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> torch.Tensor:
    """The contract above: one Triton kernel where the platform uses Triton and the tensors
    are on CUDA with contiguous last dimensions, else the reference."""
    if (PLATFORM.use_triton and q.is_cuda and q.stride(2) == 1 and k.stride(2) == 1
            and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
            and _half_is_power_of_two(q.shape[2])):
        from kernels.rope_kv_triton import rope_and_write_kv_triton

        return rope_and_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return rope_and_write_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def _half_is_power_of_two(head_dim: int) -> bool:
    half = head_dim // 2
    return head_dim % 2 == 0 and half > 0 and half & (half - 1) == 0


def rope_and_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The contract above as separate torch ops."""
    q_rot = apply_rope_ref(q, cos, sin)
    write_kv_ref(apply_rope_ref(k, cos, sin), v, k_cache, v_cache, slot_mapping)
    return q_rot.contiguous()


def rope_kv_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                             meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """`rope_and_write_kv` then `paged_attention` (the contracts above and there) for a pure
    decode step: q, k, v before rope -> attention output [T, Hq, D]. One Triton launch where
    `paged_attention` would launch the kernel, the cache is in q's dtype and rope's layout
    suits it (the head dim a power of two, last dimensions contiguous)."""
    head_dim = q.shape[2]
    if (meta.is_pure_decode and k_cache.dtype == q.dtype
            and uses_triton_kernel(q.device, k_cache.shape[1], head_dim)
            and head_dim & (head_dim - 1) == 0 and q.stride(2) == 1 and k.stride(2) == 1
            and v.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()):
        from kernels.paged_attention_triton import NewKV, paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale,
                                      new=NewKV(k, v, cos, sin, slot_mapping))
    q_rot = rope_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return paged_attention(q_rot, k_cache, v_cache, meta, scale)
