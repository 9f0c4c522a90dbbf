"""The linear layers' matmuls, dense or fp8, and a merged gate/up projection fused with its
SiLU-and-mul.

Contracts (the references, also the CPU path):
- `linear(x, w, bias)` = F.linear(x, w, bias) for a dense weight w [N, K] in x's dtype, and
  `kernels.fp8_linear.fp8_linear_ref` for an e4m3 weight with its per-output-feature scales;
- `linear_silu_and_mul(x, w)` = silu_and_mul_ref(linear(x, w)) for a merged weight
  [gate | up] [2N, K]: [M, N].

On CUDA with Triton, a step of at most `DENSE_STREAMING_ROWS` rows (small decode batches,
where the step streams the weights) through a weight of at most `DENSE_STREAMING_MAX_K`
inputs runs the weight-streaming kernel
(`kernels.skinny_linear_triton`) on dense 16-bit weights, with the SiLU-and-mul in its
epilogue for the merged projection (one kernel and one [M, 2N] round trip fewer); larger
steps run F.linear and the SiLU-and-mul kernel, through cuBLASLt up to `LT_ROWS` rows
(decode batches of 17-128) and torch's default cuBLAS above. The fp8 weights' paths are
`kernels.fp8_linear`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.fp8_linear import STREAMING_ROWS, fp8_linear, fp8_linear_ref
from kernels.platform import PLATFORM

# Up to this many rows, and up to DENSE_STREAMING_MAX_K inputs, a dense 16-bit weight is
# streamed by the Triton kernel rather than multiplied by cuBLAS (`benchmarks.skinny_gemm` on
# the H200: the kernel was ahead on llama3-8b's qkv, o and gate/up projections, K = 4,096,
# and behind cuBLAS on down_proj, K = 14,336; docs/BENCHMARKS.md).
DENSE_STREAMING_ROWS = 16
DENSE_STREAMING_MAX_K = 8192

# Up to this many rows (and above DENSE_STREAMING_ROWS) a 16-bit matmul on CUDA runs
# cuBLASLt's kernels rather than cuBLAS's (`benchmarks.skinny_gemm` on the H200 at 64 rows:
# down_proj 32.3 against 35.8 µs, gate_up 61.7 against 64.2, the others the same; at 256
# rows cuBLAS was ahead; docs/BENCHMARKS.md).
LT_ROWS = 128


def _takes_cublaslt(x: torch.Tensor) -> bool:
    """Whether a cuBLAS matmul of activation x runs cuBLASLt: CUDA, 16-bit,
    DENSE_STREAMING_ROWS < M <= LT_ROWS rows."""
    return (x.is_cuda and DENSE_STREAMING_ROWS < x.shape[0] <= LT_ROWS
            and x.dtype in (torch.bfloat16, torch.float16))


@contextlib.contextmanager
def _cublaslt() -> Iterator[None]:
    """torch's BLAS backend is one setting per process: cuBLASLt for the matmuls inside,
    the previous setting after. Only the stage's step thread runs matmuls."""
    saved = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(saved)


def _streams(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether this matmul runs the weight-streaming kernel."""
    if not (PLATFORM.use_triton and x.is_cuda and x.dim() == 2 and x.stride(1) == 1
            and w.is_contiguous()):
        return False
    if scale is not None:
        return x.shape[0] <= STREAMING_ROWS
    return (x.shape[0] <= DENSE_STREAMING_ROWS and w.shape[1] <= DENSE_STREAMING_MAX_K
            and w.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16))


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias) -> [M, N] in x's dtype; w [N, K] dense (scale None) or e4m3
    with scale [N] fp32."""
    if scale is not None:
        return fp8_linear(x, w, scale, bias)
    if _streams(x, w, None):
        from kernels.skinny_linear_triton import skinny_linear_triton

        y = skinny_linear_triton(x, w)
        return y if bias is None else y + bias
    if _takes_cublaslt(x):
        with _cublaslt():
            return F.linear(x, w, bias)
    return F.linear(x, w, bias)


def linear_silu_and_mul(x: torch.Tensor, w: torch.Tensor,
                        scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for w = [gate | up] [2N, K] (scale [2N] for e4m3):
    [M, N] in x's dtype, each projection rounded to that dtype before the SiLU-and-mul as
    `silu_and_mul_ref(linear(x, w))` rounds it."""
    if _streams(x, w, scale):
        from kernels.skinny_linear_triton import skinny_linear_triton

        return skinny_linear_triton(x, w, scale, silu=True)
    return silu_and_mul(linear(x, w, None, scale))


def linear_silu_and_mul_ref(x: torch.Tensor, w: torch.Tensor,
                            scale: torch.Tensor | None = None) -> torch.Tensor:
    """The contract, on torch ops: the fp8 weights through `fp8_linear_ref`."""
    y = F.linear(x, w) if scale is None else fp8_linear_ref(x, w, scale)
    return silu_and_mul_ref(y)
