"""Triton kernel: rotary embedding of q and k and the paged write of k and v, one program per
token (`kernels.rope_kv` holds the contract and the torch reference).

Replaces about fifteen torch kernels per layer (casts, the rotate-half concatenation, the
multiplies and adds for q and for k, two scatter writes) with one pass: each token's q, k and
v are read once, rotated q is written once, and k, v go straight to their KV slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_format import FP8


@triton.jit
def _rotate(X, C, S, heads, stride_h, HALF: tl.constexpr, H_PAD: tl.constexpr,
            OUT_DTYPE: tl.constexpr):
    """Rows [heads, 2 * HALF] at X (head stride stride_h): (first half, second half) of
    x * cos + rotate_half(x) * sin, each product and the sum rounded to OUT_DTYPE."""
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, HALF)
    ok = (h < heads)[:, None]
    ptr = X + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(C + d).to(OUT_DTYPE).to(tl.float32)[None, :]
    c2 = tl.load(C + HALF + d).to(OUT_DTYPE).to(tl.float32)[None, :]
    s1 = tl.load(S + d).to(OUT_DTYPE).to(tl.float32)[None, :]
    s2 = tl.load(S + HALF + d).to(OUT_DTYPE).to(tl.float32)[None, :]
    # rotate_half(x) = (-x2, x1); rounding each product as torch's ops do
    lo = (x1 * c1).to(OUT_DTYPE).to(tl.float32) + (-x2 * s1).to(OUT_DTYPE).to(tl.float32)
    hi = (x2 * c2).to(OUT_DTYPE).to(tl.float32) + (x1 * s2).to(OUT_DTYPE).to(tl.float32)
    return lo.to(OUT_DTYPE), hi.to(OUT_DTYPE), h, d, ok


@triton.jit
def _rope_rows(x, x_partner, cos, sin, upper, DTYPE: tl.constexpr):
    """x * cos + rotate_half(x) * sin over whole rows [.., D], `_rotate`'s roundings (the
    decode attention launch rotates rows in place, `kernels.paged_attention_triton`):
    x_partner holds each element's other half (d + D/2 for the first half, d - D/2 for the
    second), `upper` marks the second half; cos, sin already rounded to DTYPE, each product
    and the sum rounded to DTYPE."""
    x = x.to(tl.float32)
    xc = (x * cos).to(DTYPE).to(tl.float32)
    xs = (x_partner.to(tl.float32) * sin).to(DTYPE).to(tl.float32)
    return tl.where(upper, xc + xs, xc - xs).to(DTYPE)


@triton.jit
def _to_cache(x, CACHE_DTYPE: tl.constexpr, FP8_KV: tl.constexpr):
    """x as the cache stores it: a cast, or (FP8_KV) the bits of x rounded to nearest even on
    e4m3's grid and saturated to +-448. The rounding is done here in fp32 (3 mantissa bits;
    below 2^-6, multiples of 2^-9) so the cast itself is exact: Triton's interpreter rounds
    fp8 casts without carrying into the exponent."""
    if FP8_KV:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        mag_bits = bits & 0x7FFFFFFF
        mag = mag_bits.to(tl.float32, bitcast=True)
        normal = ((mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) & 0x7FF00000).to(
            tl.float32, bitcast=True)
        subnormal = (mag + 24576.0) - 24576.0  # 1.5 * 2^14: fp32's step there is 2^-9
        mag = tl.minimum(tl.where(mag < 0.015625, subnormal, normal), 448.0)
        # The sign as a bit (-0 included: the GPU's conversions drop a zero's sign).
        sign = ((bits >> 31) << 7).to(tl.uint8)
        return mag.to(tl.float8e4nv).to(tl.uint8, bitcast=True) | sign
    return x.to(CACHE_DTYPE)


@triton.jit
def _rope_kv_kernel(Q, K, V, COS, SIN, QO, KC, VC, SLOTS,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_ct, stride_ot, stride_oh, stride_cn, stride_cb, stride_ch,
                    num_q_heads, num_kv_heads, block_size,
                    HALF: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
                    FP8_KV: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dtype = QO.dtype.element_ty
    cos = COS + t * stride_ct
    sin = SIN + t * stride_ct
    lo, hi, h, d, ok = _rotate(Q + t * stride_qt, cos, sin, num_q_heads, stride_qh, HALF,
                               HQ_PAD, dtype)
    out = QO + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(out, lo, mask=ok)
    tl.store(out + HALF, hi, mask=ok)

    slot = tl.load(SLOTS + t).to(tl.int64)
    # The contract says every slot is >= 0; a negative one writes nothing (never outside
    # the pool).
    heads = tl.where(slot >= 0, num_kv_heads, 0)  # no head of a negative slot is written
    at = tl.maximum(slot, 0)
    base = (at // block_size) * stride_cn + (at % block_size) * stride_cb
    k_lo, k_hi, kh, kd, k_ok = _rotate(K + t * stride_kt, cos, sin, heads, stride_kh, HALF,
                                       HKV_PAD, dtype)
    cache = base + kh[:, None] * stride_ch + kd[None, :]
    kv_dtype = KC.dtype.element_ty
    tl.store(KC + cache, _to_cache(k_lo, kv_dtype, FP8_KV), mask=k_ok)
    tl.store(KC + cache + HALF, _to_cache(k_hi, kv_dtype, FP8_KV), mask=k_ok)
    src = V + t * stride_vt + kh[:, None] * stride_vh + kd[None, :]
    tl.store(VC + cache, _to_cache(tl.load(src, mask=k_ok), kv_dtype, FP8_KV), mask=k_ok)
    tl.store(VC + cache + HALF, _to_cache(tl.load(src + HALF, mask=k_ok), kv_dtype, FP8_KV),
             mask=k_ok)


def rope_and_write_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """`kernels.rope_kv`'s contract; one program per token."""
    tokens, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    assert dim % 2 == 0 and dim // 2 == triton.next_power_of_2(dim // 2), "head dim 2^n"
    assert cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    out = torch.empty(tokens, q_heads, dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    fp8_kv = k_cache.dtype == FP8
    if fp8_kv:  # written as bits (Triton's interpreter has no fp8 arrays)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _rope_kv_kernel[(tokens,)](
        q, k, v, cos, sin, out, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        q_heads, kv_heads, k_cache.shape[1],
        HALF=dim // 2, HQ_PAD=triton.next_power_of_2(q_heads),
        HKV_PAD=triton.next_power_of_2(kv_heads), FP8_KV=fp8_kv, num_warps=4)
    return out
