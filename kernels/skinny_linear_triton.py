"""The weight-streaming Triton kernel of the linear layers at decode batch sizes (few rows).

With M <= SKINNY_ROWS rows a step of a linear layer reads the whole weight to do 2 M FLOPs
per weight element: its time is the weight's bytes over the copy rate. One kernel serves
both weight formats:
- dense bf16/fp16 weights [N, K] (`kernels.linear` states the contract, F.linear's);
- e4m3 weights with one scale per output feature (`kernels.fp8_linear`'s contract): the
  bytes are bitcast and widened in registers, the scales applied once after the fp32
  accumulation.
Each program owns BLOCK_N output columns of every row and a range of K (split_k programs
share a column block's K when the blocks alone are too few to keep enough bytes in flight;
a second kernel adds their fp32 partial sums). The rows are padded to a tile of 16, 32 or
64 (tl.dot's smallest is 16).

Optionally the program computes a merged gate/up projection's SiLU-and-mul in its epilogue
(`SILU`): for output column j it reads weight rows j (gate) and N + j (up) and writes
silu(gate) * up with `kernels.activation.silu_and_mul_ref`'s rounding (each product rounded
to the output dtype first, as the two ops apart).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8_format import FP8, SKINNY_ROWS
from kernels.platform import TRITON_INTERPRETED


@dataclass(frozen=True)
class SkinnyLaunch:
    """One launch of the weight-streaming kernel: output columns and reduction depth per
    program, warps, pipeline stages, and how many programs share one column block's K
    (split_k > 1: each writes fp32 partial sums, a second kernel adds them)."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1


# About this many programs keep enough e4m3 weight bytes in flight on an H200 (132 SMs); an
# e4m3 weight with fewer column blocks splits its K (`benchmarks.fp8_gemm`). A 16-bit weight
# moves twice the bytes per program and splits nothing: on the H200 every split was slower
# for llama3-8b's bf16 projections (`benchmarks.skinny_gemm`, docs/BENCHMARKS.md).
TARGET_PROGRAMS = 512


def skinny_launch(n: int, k: int, *, fp8: bool = True, silu: bool = False) -> SkinnyLaunch:
    """The launch for a weight of n output columns and k inputs, from `benchmarks.skinny_gemm`
    and `benchmarks.fp8_gemm` on llama3-8b's projections on the H200. e4m3: 64 columns per
    program and 3 stages from 6,144 columns, 32 and 4 below, K split in up to 8 where the
    column blocks are fewer than TARGET_PROGRAMS; a fused SiLU (n is its output) takes the
    launch of the 2n-column weight with half its columns. 16-bit: 64 columns from 6,144 and
    32 below, 4 stages, and the fused SiLU 64 columns (128 weight rows) with 3 stages."""
    if not fp8:
        if silu:
            return SkinnyLaunch(block_n=64, num_stages=3)
        return SkinnyLaunch(block_n=64) if n >= 6144 else SkinnyLaunch()
    if silu:
        whole = skinny_launch(2 * n, k)
        return SkinnyLaunch(max(16, whole.block_n // 2), whole.block_k, whole.num_warps,
                            whole.num_stages, whole.split_k)
    launch = SkinnyLaunch(block_n=64, num_stages=3) if n >= 6144 else SkinnyLaunch()
    blocks = triton.cdiv(n, launch.block_n)
    split = 1
    while split < 8 and blocks * split * 2 <= TARGET_PROGRAMS \
            and triton.cdiv(k, launch.block_k) >= split * 2 * 2:
        split *= 2
    return SkinnyLaunch(launch.block_n, launch.block_k, launch.num_warps, launch.num_stages,
                        split)


@triton.jit
def _silu_mul(gate, up, DTYPE: tl.constexpr):
    """silu(gate) * up for fp32 values already rounded to DTYPE: the silu rounded to DTYPE,
    the product in fp32 (`kernels.elementwise_triton`'s SiLU-and-mul)."""
    silu = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    return silu * up


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(X, W, S, Y, M, N, K, stride_xm, stride_wn, stride_ym, k_tiles,
                   ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN: tl.constexpr, PARTIAL: tl.constexpr, FP8_W: tl.constexpr,
                   SILU: tl.constexpr, WIDEN: tl.constexpr):
    """Y[:M, n-block] = X[:M] @ W[n-block, K-range].T (FP8_W: W holds e4m3 bytes, scaled by
    S[n-block] after the accumulation). Program (n-block, s) covers K tiles
    [s * k_tiles, (s + 1) * k_tiles). SILU: W is [2N, K] (gate rows, then up rows) and Y
    gets silu(gate) * up. PARTIAL: Y is fp32 partial sums [splits, M, N] (row stride
    stride_ym, split stride M * stride_ym); with SILU, gate sums in columns [0, N) and up
    sums in [N, 2N) of rows of stride_ym = 2N. WIDEN: 16-bit inputs multiplied as fp32 (the
    interpreter has no 16-bit matmul; the products are exact either way)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, ROWS)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * k_tiles * BLOCK_K
    offs_k = k_start + tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    n_ok = offs_n < N
    x_ptr = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptr = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    up_ptr = w_ptr + N * stride_wn  # SILU only
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k in range(0, k_tiles):
        if EVEN:  # N % BLOCK_N == 0 and K % (BLOCK_K * splits) == 0
            x = tl.load(x_ptr, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptr)
            if SILU:
                w_up = tl.load(up_ptr)
        else:
            k_ok = (k_start + k * BLOCK_K + tl.arange(0, BLOCK_K)) < K
            x = tl.load(x_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if SILU:
                w_up = tl.load(up_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if FP8_W:
            w = w.to(tl.float8e4nv, bitcast=True)
            if SILU:
                w_up = w_up.to(tl.float8e4nv, bitcast=True)
        if FP8_W or WIDEN:
            # e4m3 and bf16/fp16 values are exact in tf32 (3 and 7/10 mantissa bits against
            # 10), so the tf32 tensor-core products are exact; the sums are fp32.
            xf = x.to(tl.float32)
            acc += tl.dot(xf, tl.trans(w.to(tl.float32)), input_precision="tf32")
            if SILU:
                acc_up += tl.dot(xf, tl.trans(w_up.to(tl.float32)), input_precision="tf32")
        else:  # 16-bit products (exact in fp32), fp32 sums: cuBLAS's numerics
            acc += tl.dot(x, tl.trans(w))
            if SILU:
                acc_up += tl.dot(x, tl.trans(w_up))
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
        if SILU:
            up_ptr += BLOCK_K
    if FP8_W:
        acc = acc * tl.load(S + offs_n, mask=n_ok, other=0.0)[None, :]
        if SILU:
            acc_up = acc_up * tl.load(S + N + offs_n, mask=n_ok, other=0.0)[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    y_ptr = Y + split * M * stride_ym + offs_m[:, None] * stride_ym + offs_n[None, :]
    if PARTIAL:
        tl.store(y_ptr, acc, mask=mask)
        if SILU:
            tl.store(y_ptr + N, acc_up, mask=mask)
    elif SILU:
        dtype = Y.dtype.element_ty
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        tl.store(y_ptr, _silu_mul(gate, up, dtype).to(dtype), mask=mask)
    else:
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(P, Y, MN, N, SPLITS: tl.constexpr, SILU: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Y.flat[i] = sum over s of P[s].flat[i] (P [SPLITS, M, N] fp32, Y [M, N] contiguous).
    SILU: P is [SPLITS, M, 2N] (gate sums, then up sums) and Y gets silu(gate) * up."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    dtype = Y.dtype.element_ty
    if SILU:
        src = (offs // N) * (2 * N) + offs % N
        gate = tl.zeros([BLOCK], dtype=tl.float32)
        up = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(SPLITS):
            gate += tl.load(P + s * 2 * MN + src, mask=ok, other=0.0)
            up += tl.load(P + s * 2 * MN + src + N, mask=ok, other=0.0)
        out = _silu_mul(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
    else:
        out = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(SPLITS):
            out += tl.load(P + s * MN + offs, mask=ok, other=0.0)
    tl.store(Y + offs, out.to(dtype), mask=ok)


def skinny_linear_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                         *, silu: bool = False,
                         launch: SkinnyLaunch | None = None) -> torch.Tensor:
    """x [M, K] (M <= SKINNY_ROWS, bf16/fp16, rows contiguous) @ w.T -> [M, N] in x's dtype,
    no bias. w [N, K] contiguous: x's dtype (scale None), or e4m3 with scale [N] fp32.
    silu: w is a merged [gate | up] weight [2N, K] (scale [2N]) and the result is
    silu(gate) * up, [M, N]."""
    m, k = x.shape
    fp8 = w.dtype == FP8
    assert m <= SKINNY_ROWS and x.stride(1) == 1 and w.is_contiguous()
    assert (scale is not None) == fp8 and (fp8 or w.dtype == x.dtype), (w.dtype, x.dtype)
    n = w.shape[0] // 2 if silu else w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    lc = launch or skinny_launch(n, k, fp8=fp8, silu=silu)
    tiles = triton.cdiv(k, lc.block_k)
    splits = max(1, min(lc.split_k, tiles))
    k_tiles = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, k_tiles)  # every split has work
    even = n % lc.block_n == 0 and k == k_tiles * splits * lc.block_k
    width = 2 * n if silu else n  # a partial row holds gate and up sums
    target = out if splits == 1 else torch.empty(splits, m, width, dtype=torch.float32,
                                                 device=x.device)
    _skinny_kernel[(triton.cdiv(n, lc.block_n), splits)](
        x, w.view(torch.uint8) if fp8 else w, scale if fp8 else w, target, m, n, k,
        x.stride(0), w.stride(0), width if splits > 1 else n, k_tiles,
        ROWS=max(16, triton.next_power_of_2(m)), BLOCK_N=lc.block_n, BLOCK_K=lc.block_k,
        EVEN=even, PARTIAL=splits > 1, FP8_W=fp8, SILU=silu, WIDEN=TRITON_INTERPRETED,
        num_warps=lc.num_warps,
        num_stages=lc.num_stages)
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](target, out, m * n, n, SPLITS=splits,
                                                          SILU=silu, BLOCK=block, num_warps=4)
    return out
