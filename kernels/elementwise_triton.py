"""Triton kernels for the per-token ops of a decoder layer: RMSNorm, the residual add fused
with the RMSNorm after it, and SiLU-and-mul.

Same contracts as the torch references (`kernels.rms_norm.rms_norm_ref`,
`kernels.rms_norm.add_rms_norm_ref`, `kernels.activation.silu_and_mul_ref`), which stay the
CPU path and the oracle. Each
replaces a chain of torch kernels (RMSNorm: square, mean, rsqrt, two multiplies and casts)
with one pass over the data: at decode batch sizes those chains were hundreds of small
kernels per step, and at prefill they moved the activations several times.

Rounding follows the references, so bf16 results match them up to the order of the fp32
sum: statistics and SiLU in fp32, the normalised row cast to the input dtype before the
weight multiply (HF Llama's order), the SiLU cast to the input dtype before the multiply
by `up`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, W, Y, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(var + eps)).to(Y.dtype.element_ty)
    w = tl.load(W + cols, mask=ok, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (rows contiguous), weight [H] -> [T, H] in x's dtype; one program per row."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous()
    rows, cols = x.shape
    out = torch.empty_like(x)
    if rows == 0:
        return out
    block = triton.next_power_of_2(cols)
    _rms_norm_kernel[(rows,)](x, weight, out, x.stride(0), out.stride(0), cols, eps,
                              BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out


@triton.jit
def _add_rms_norm_kernel(X, R, W, Y, S, stride_x, stride_r, stride_y, stride_s, n_cols, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    s = (x + r).to(S.dtype.element_ty)  # rounded as torch's add rounds it
    tl.store(S + row * stride_s + cols, s, mask=ok)
    s32 = s.to(tl.float32)
    var = tl.sum(s32 * s32, axis=0) / n_cols
    normed = (s32 * tl.rsqrt(var + eps)).to(Y.dtype.element_ty)
    w = tl.load(W + cols, mask=ok, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=ok)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] (rows contiguous, one dtype), weight [H] -> (rms_norm(x + residual),
    x + residual), both [T, H] in x's dtype; one program per row, one read of each input."""
    assert x.dim() == 2 and x.stride(1) == 1 and residual.stride(1) == 1
    assert x.shape == residual.shape and x.dtype == residual.dtype and weight.is_contiguous()
    rows, cols = x.shape
    out, summed = torch.empty_like(x), torch.empty_like(x)
    if rows == 0:
        return out, summed
    block = triton.next_power_of_2(cols)
    _add_rms_norm_kernel[(rows,)](x, residual, weight, out, summed, x.stride(0),
                                  residual.stride(0), out.stride(0), summed.stride(0), cols,
                                  eps, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out, summed


@triton.jit
def _silu_and_mul_kernel(GU, OUT, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(GU + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_gu + n_cols + cols, mask=ok, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(OUT.dtype.element_ty)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(OUT + row * stride_out + cols, out.to(OUT.dtype.element_ty), mask=ok)


SILU_BLOCK = 1024


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] laid out [gate | up] (rows contiguous) -> silu(gate) * up, [T, I]."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    rows, width = gate_up.shape
    half = width // 2
    out = torch.empty(rows, half, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    grid = (rows, triton.cdiv(half, SILU_BLOCK))
    _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), half,
                               BLOCK=SILU_BLOCK, num_warps=4)
    return out
