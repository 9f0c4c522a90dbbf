"""Triton kernels of the fp8 linear layers (`kernels.fp8_linear` states the contract and
holds the references). The e4m3 tensors are passed as their bytes (uint8 views) and
bitcast in the kernels, which Triton's interpreter also runs exactly."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8_format import FP8, FP8_MAX, SKINNY_ROWS


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


# About this many programs keep enough weight bytes in flight on an H200 (132 SMs); a
# weight with fewer column blocks splits its K (`benchmarks.fp8_gemm`).
TARGET_PROGRAMS = 512


def skinny_launch(n: int, k: int) -> SkinnyLaunch:
    """The launch for a weight [n, k]: 64 columns per program and 3 stages from 6,144
    rows, 32 and 4 below (llama3-8b's projections on the H200), and K split in up to 8
    where the column blocks are fewer than TARGET_PROGRAMS."""
    launch = SkinnyLaunch(block_n=64, num_stages=3) if n >= 6144 else SkinnyLaunch()
    blocks = triton.cdiv(n, launch.block_n)
    split = 1
    while split < 8 and blocks * split * 2 <= TARGET_PROGRAMS \
            and triton.cdiv(k, launch.block_k) >= split * 2 * 2:
        split *= 2
    return SkinnyLaunch(launch.block_n, launch.block_k, launch.num_warps, launch.num_stages,
                        split)


@triton.jit(do_not_specialize=["M"])
def _fp8_skinny_kernel(X, Q, S, Y, M, N, K, stride_xm, stride_qn, stride_ym, k_tiles,
                       ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN: tl.constexpr, PARTIAL: tl.constexpr):
    """Y[:M, n-block] = (X[:M] @ Q[n-block, K-range].T) * S[n-block]: e4m3 weights widened
    in registers, fp32 accumulation, the row scales applied once at the end. Program
    (n-block, s) covers K tiles [s * k_tiles, (s + 1) * k_tiles); PARTIAL: Y is the fp32
    partial sums [splits, M, N] (row stride stride_ym, split stride M * stride_ym)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, ROWS)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * k_tiles * BLOCK_K
    offs_k = k_start + tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    n_ok = offs_n < N
    x_ptr = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    q_ptr = Q + offs_n.to(tl.int64)[:, None] * stride_qn + offs_k[None, :]
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k in range(0, k_tiles):
        if EVEN:  # N % BLOCK_N == 0 and K % (BLOCK_K * splits) == 0
            w = tl.load(q_ptr)
            x = tl.load(x_ptr, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = (k_start + k * BLOCK_K + tl.arange(0, BLOCK_K)) < K
            w = tl.load(q_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # e4m3 and bf16/fp16 values are exact in tf32 (3 and 7/10 mantissa bits against
        # 10), so the tf32 tensor-core products are exact; the sums are fp32.
        w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="tf32")
        x_ptr += BLOCK_K
        q_ptr += BLOCK_K
    scale = tl.load(S + offs_n, mask=n_ok, other=0.0)
    out = acc * scale[None, :]
    y_ptr = Y + split * M * stride_ym + offs_m[:, None] * stride_ym + offs_n[None, :]
    if PARTIAL:
        tl.store(y_ptr, out, mask=row_ok[:, None] & n_ok[None, :])
    else:
        tl.store(y_ptr, out.to(Y.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(P, Y, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Y.flat[i] = sum over s of P[s].flat[i] (P [SPLITS, M, N] fp32, Y [M, N] contiguous)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(P + s * MN + offs, mask=ok, other=0.0)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


def fp8_linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      launch: SkinnyLaunch | None = None) -> torch.Tensor:
    """x [M, K] (M <= SKINNY_ROWS, bf16/fp16, rows contiguous), q [N, K] e4m3 contiguous,
    scale [N] fp32 -> [M, N] in x's dtype (`fp8_linear_ref` without the bias). The rows are
    padded to a tile of 16, 32 or 64 (tl.dot's smallest is 16)."""
    m, k = x.shape
    n = q.shape[0]
    assert m <= SKINNY_ROWS and x.stride(1) == 1 and q.is_contiguous() and q.dtype == FP8
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    lc = launch or skinny_launch(n, k)
    tiles = triton.cdiv(k, lc.block_k)
    splits = max(1, min(lc.split_k, tiles))
    k_tiles = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, k_tiles)  # every split has work
    even = n % lc.block_n == 0 and k == k_tiles * splits * lc.block_k
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32,
                                                 device=x.device)
    _fp8_skinny_kernel[(triton.cdiv(n, lc.block_n), splits)](
        x, q.view(torch.uint8), scale, target, m, n, k, x.stride(0), q.stride(0), n, k_tiles,
        ROWS=max(16, triton.next_power_of_2(m)), BLOCK_N=lc.block_n, BLOCK_K=lc.block_k,
        EVEN=even, PARTIAL=splits > 1, num_warps=lc.num_warps, num_stages=lc.num_stages)
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](target, out, m * n, SPLITS=splits,
                                                          BLOCK=block, num_warps=4)
    return out


@triton.jit
def _quantize_rows_kernel(X, Q, S, stride_x, stride_q, n_cols, fp8_max,
                          BLOCK: tl.constexpr):
    """One program per row: its largest magnitude sets its scale; the row divided by it
    is stored as e4m3."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(X + row * stride_x + start + offs, mask=start + offs < n_cols, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    # IEEE-rounded divisions (Triton's `/` is approximate), as the reference's torch ones
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), fp8_max)
    tl.store(S + row, scale)
    for start in range(0, n_cols, BLOCK):
        mask = start + offs < n_cols
        x = tl.load(X + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
        q = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # e4m3 bytes
        tl.store(Q + row * stride_q + start + offs, q, mask=mask)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_ref` on the GPU: x [M, K] rows contiguous -> (e4m3 [M, K], [M] fp32)."""
    m, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q.view(torch.uint8), scale, x.stride(0), q.stride(0),
                                    k, FP8_MAX,
                                    BLOCK=min(4096, triton.next_power_of_2(k)), num_warps=4)
    return q, scale
