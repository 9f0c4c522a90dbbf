"""The linear layers' matmuls (`kernels.linear`): the weight-streaming kernel on dense 16-bit
weights and the gate/up projection with its SiLU-and-mul fused in, each against the torch
reference and a float64 oracle, in Triton's interpreter on CPU and on the GPU (eager and
inside a CUDA graph); on CPU the dispatch is the reference itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul_ref
from kernels.fp8_linear import quantize_weight
from kernels.linear import linear, linear_silu_and_mul, linear_silu_and_mul_ref
from tests.kernels.interpreter import run_interpreted

# (rows, out, in): a decode row, odd sizes (masked tiles, K not a tile multiple), 16 rows.
SMALL = ((1, 64, 512), (5, 96, 300), (16, 40, 256))
# llama3-8b's projections at TP 1 (out, in): qkv, o, gate_up, down.
LLAMA = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))


def _oracle(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T in float64 (w widened and scaled when it is e4m3)."""
    wd = w.double() if scale is None else w.double() * scale.double()[:, None]
    return x.double() @ wd.T


def check_streaming(device: str, shapes: tuple[tuple[int, int, int], ...],
                    dtypes: tuple[torch.dtype, ...]) -> None:
    """The streaming kernel against the reference and the float64 oracle, dense and fused
    with the SiLU-and-mul (dense and e4m3 weights), for the launch picked by shape and with
    K split over 2 and 4 programs. The products are exact and the sums fp32, so the gaps
    are the output's rounding and the sums' order: a few ulps of the output's dtype."""
    from kernels.skinny_linear_triton import SkinnyLaunch, skinny_linear_triton

    launches = (None, SkinnyLaunch(split_k=2), SkinnyLaunch(block_n=64, block_k=128, split_k=4))
    g = torch.Generator().manual_seed(5)
    for dtype in dtypes:
        ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
        for m, n, k in shapes:
            x = torch.randn(m, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
            ref = F.linear(x.float(), w.float()).to(dtype)  # fp32 sums, rounded once
            oracle = _oracle(x, w, None)
            merged = (torch.randn(2 * n, k, generator=g) / k**0.5).to(dtype)
            ref_silu = silu_and_mul_ref(F.linear(x.float(), merged.float()).to(dtype))
            q, scale = quantize_weight(merged.float())
            ref_fp8 = linear_silu_and_mul_ref(x, q, scale)
            for launch in launches:
                got = skinny_linear_triton(x.to(device), w.to(device), launch=launch).cpu()
                assert got.dtype == dtype and got.shape == (m, n)
                top = oracle.abs().max().item()
                assert (got.double() - oracle).abs().max().item() <= 2 * ulp * top, launch
                assert (got.float() - ref.float()).abs().max().item() <= 2 * ulp * top, launch
                for wt, sc, want in ((merged, None, ref_silu), (q, scale, ref_fp8)):
                    fused = skinny_linear_triton(
                        x.to(device), wt.to(device), None if sc is None else sc.to(device),
                        silu=True, launch=launch).cpu()
                    assert fused.dtype == dtype and fused.shape == (m, n)
                    # the inputs of the SiLU may round to neighbouring values (sums' order)
                    gap = (fused.float() - want.float()).abs().max().item()
                    limit = 4 * ulp * max(1.0, want.float().abs().max().item())
                    assert gap <= limit, f"{dtype} {m}x{n}x{k} {launch} fp8={sc is not None}"


def test_cpu_tensors_take_the_reference() -> None:
    g = torch.Generator().manual_seed(6)
    x, w, b = torch.randn(3, 32, generator=g), torch.randn(24, 32, generator=g), torch.randn(24)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    merged = torch.randn(48, 32, generator=g)
    assert torch.equal(linear_silu_and_mul(x, merged), silu_and_mul_ref(F.linear(x, merged)))
    q, scale = quantize_weight(merged)
    assert torch.equal(linear_silu_and_mul(x, q, scale), linear_silu_and_mul_ref(x, q, scale))
    want = silu_and_mul_ref(_oracle(x, q, scale))
    assert torch.allclose(linear_silu_and_mul(x, q, scale).double(), want, atol=1e-5)


def test_streaming_kernel_in_the_interpreter() -> None:
    run_interpreted("import torch\n"
                    "from tests.kernels.test_linear import SMALL, check_streaming\n"
                    "check_streaming('cpu', SMALL, (torch.bfloat16, torch.float16))\n")


@pytest.mark.gpu
def test_streaming_kernel_on_cuda() -> None:
    shapes = SMALL + tuple((m, n, k) for m in (1, 16) for n, k in LLAMA)
    check_streaming("cuda", shapes, (torch.bfloat16, torch.float16))


@pytest.mark.gpu
def test_dispatch_replays_in_a_cuda_graph() -> None:
    """`linear` / `linear_silu_and_mul` at a streamed and a cuBLAS row count, captured and
    replayed, give their eager results bit for bit."""
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    merged = torch.randn(2 * 4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    for m in (1, 64):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        want = (linear(x, w), linear_silu_and_mul(x, merged))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = (linear(x, w), linear_silu_and_mul(x, merged))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, want, strict=True)), m


@pytest.mark.gpu
def test_cublaslt_rows_match_the_oracle_and_leave_the_backend_setting() -> None:
    """At 17-128 rows `linear` runs cuBLASLt (`kernels.linear.LT_ROWS`), above them cuBLAS:
    either way within a few ulps of the float64 product, and torch's process-wide BLAS
    setting is what it was before the call."""
    g = torch.Generator(device="cuda").manual_seed(7)
    w = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16, generator=g) / 128
    before = torch.backends.cuda.preferred_blas_library()
    for m in (17, 32, 64, 128, 256):
        x = torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16, generator=g)
        got = linear(x, w)
        want = _oracle(x, w, None)
        limit = 2 * 2**-7 * want.abs().max().item()
        assert (got.double() - want).abs().max().item() <= limit, m
        assert torch.backends.cuda.preferred_blas_library() == before, m
