"""FP8 (e4m3) linear layers: weights quantized per output channel once, at load.

Contract (`fp8_linear_ref`, also the CPU path): a weight w [N, K] is stored as
q [N, K] float8_e4m3fn and scale [N] fp32 with w ~= q * scale[:, None] (`quantize_weight`:
each row's largest magnitude maps to e4m3's largest, 448), and

    fp8_linear(x [M, K], q, scale, bias) = x @ (q * scale[:, None]).T + bias   in x's dtype,

the weights alone quantized (W8A16). On CUDA, with Triton:
- M <= STREAMING_ROWS (small decode batches; the step streams the weights): a kernel reads
  the e4m3 weights, widens them in registers and applies the row scales after the fp32
  accumulation (`kernels.skinny_linear_triton`): the reference's numerics up to summation
  order, half the bytes of a bf16 weight;
- larger M (prefill, large batches; the step is compute-bound): activations are quantized
  per token to e4m3 as well (`quantize_rows_triton`) and multiplied on the FP8 tensor cores
  by `torch._scaled_mm` with row-wise scales (W8A8 with dynamic activation scales, as vLLM's
  `fp8` quantization). That path's reference is `fp8_linear_w8a8_ref`.
The LM head and the embedding stay in the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8_format import FP8, FP8_MAX, SKINNY_ROWS
from kernels.platform import PLATFORM

__all__ = ["FP8", "FP8_MAX", "SKINNY_ROWS", "STREAMING_ROWS", "fp8_linear", "fp8_linear_ref",
           "fp8_linear_w8a8_ref", "quantize_rows_ref", "quantize_weight"]

# Up to this many rows the weight-streaming kernel runs, above it `_scaled_mm`
# (`benchmarks.fp8_gemm` on the H200: the kernel is ahead at 16 rows, docs/BENCHMARKS.md).
STREAMING_ROWS = 16

_TINY = 1e-12  # a zero row's scale: any positive value keeps its zeros exact


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] float8_e4m3fn, scale [N] fp32), per output channel: the rows'
    quantization (`quantize_rows_ref`)."""
    return quantize_rows_ref(w)


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M] fp32), per row: each row's largest
    magnitude maps to e4m3's largest (activations per token, weights per output feature)."""
    scale = x.abs().amax(dim=1).float().clamp(min=_TINY) / FP8_MAX
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The contract (module docstring), in fp32: [M, K] -> [M, N] in x's dtype."""
    w = q.float() * scale[:, None]
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


def fp8_linear_w8a8_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """The large-M CUDA path's numerics: x quantized per token first, then as the
    reference."""
    xq, xs = quantize_rows_ref(x)
    y = F.linear(xq.float() * xs[:, None], q.float() * scale[:, None])
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ the fp8 weight: the CUDA paths of the module
    docstring where the platform uses Triton, else `fp8_linear_ref`."""
    if not (PLATFORM.use_triton and x.is_cuda and x.dim() == 2 and x.stride(1) == 1):
        return fp8_linear_ref(x, q, scale, bias)
    from kernels.fp8_linear_triton import quantize_rows_triton
    from kernels.skinny_linear_triton import skinny_linear_triton

    if x.shape[0] <= STREAMING_ROWS:
        y = skinny_linear_triton(x, q, scale)
    else:
        xq, xs = quantize_rows_triton(x)
        y = torch._scaled_mm(xq, q.t(), scale_a=xs[:, None], scale_b=scale[None, :],
                             out_dtype=x.dtype)
    return y if bias is None else y + bias
