"""The per-token activation quantization of the fp8 linear layers' large-M path
(`kernels.fp8_linear` states the contract and holds the reference). The e4m3 tensors are
passed as their bytes (uint8 views), which Triton's interpreter also runs exactly; the
small-M path is `kernels.skinny_linear_triton`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_format import FP8, FP8_MAX


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
