"""The Triton RMSNorm, add + RMSNorm and SiLU-and-mul kernels against a float64 oracle and the torch
references: on CUDA (marker `gpu`), and on this machine through Triton's interpreter when
triton is installed (it is a `gpu` extra, so CI without it skips that test)."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.rms_norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from tests.kernels.interpreter import run_interpreted

# (rows, hidden): one decode row, an odd batch, a prefill-sized block; SmolLM2's 576 (not a
# power of two), llama3-8b's 4096, and a width below one warp's worth.
NORM_SHAPES = ((1, 576), (7, 4096), (300, 576), (5, 100))
# (rows, intermediate): SmolLM2's 1536, llama3-8b's 14336 (several column blocks), odd sizes.
SILU_SHAPES = ((1, 1536), (9, 14336), (130, 1536), (3, 1000))
# Per dtype: the largest allowed gap to the torch reference, elementwise, relative to the
# output's scale (the sum's order differs; bf16 then may round one ulp apart).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# The interpreter (CI's CPU check) runs one program per row in Python: every width, without
# the prefill-sized row counts, which the GPU test keeps.
INTERPRETED_NORM_SHAPES = tuple(s for s in NORM_SHAPES if s[0] < 100)
INTERPRETED_SILU_SHAPES = tuple(s for s in SILU_SHAPES if s[0] < 100)


def _close(got: torch.Tensor, ref: torch.Tensor, oracle: torch.Tensor, dtype: torch.dtype,
           what: str) -> None:
    tol = TOLERANCE[dtype] * max(1.0, oracle.abs().max().item())
    gap = (got.double().cpu() - ref.double().cpu()).abs().max().item()
    err = (got.double().cpu() - oracle).abs().max().item()
    ref_err = (ref.double().cpu() - oracle).abs().max().item()
    assert gap <= tol, f"{what}: {gap} from the reference (tolerance {tol})"
    assert err <= ref_err + tol, f"{what}: {err} from float64, the reference {ref_err}"


def check(device: str, dtypes: tuple[torch.dtype, ...],
          norm_shapes: tuple[tuple[int, int], ...] = NORM_SHAPES,
          silu_shapes: tuple[tuple[int, int], ...] = SILU_SHAPES) -> None:
    """Every kernel, shape and dtype, against the float64 oracle and the reference."""
    from kernels.elementwise_triton import (
        add_rms_norm_triton,
        rms_norm_triton,
        silu_and_mul_triton,
    )

    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for rows, hidden in norm_shapes:
            x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
            w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
            x64, w64 = x.double(), w.double()
            oracle = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
            got = rms_norm_triton(x.to(device), w.to(device), 1e-5)
            assert got.dtype == dtype and got.shape == x.shape
            _close(got, rms_norm_ref(x, w, 1e-5), oracle, dtype,
                   f"rms_norm {dtype} {rows}x{hidden}")
            r = (torch.randn(rows, hidden, generator=gen) * 2).to(dtype)
            normed, summed = add_rms_norm_triton(x.to(device), r.to(device), w.to(device), 1e-5)
            ref_normed, ref_summed = add_rms_norm_ref(x, r, w, 1e-5)
            assert torch.equal(summed.cpu(), ref_summed), "the sum rounds as torch's add"
            s64 = ref_summed.double()  # the norm reads the rounded sum, as the ops apart do
            oracle = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
            _close(normed, ref_normed, oracle, dtype, f"add_rms_norm {dtype} {rows}x{hidden}")
        for rows, inter in silu_shapes:
            gu = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
            g64, u64 = gu.double().chunk(2, dim=-1)
            oracle = g64 * torch.sigmoid(g64) * u64
            got = silu_and_mul_triton(gu.to(device))
            assert got.dtype == dtype and got.shape == (rows, inter)
            _close(got, silu_and_mul_ref(gu), oracle, dtype,
                   f"silu_and_mul {dtype} {rows}x{inter}")


def test_cpu_tensors_take_the_references() -> None:
    x, w = torch.randn(3, 8), torch.rand(8)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    r = torch.randn(3, 8)
    normed, summed = add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, x + r) and torch.equal(normed, rms_norm_ref(x + r, w, 1e-6))
    gu = torch.randn(3, 16)
    assert torch.equal(silu_and_mul(gu), silu_and_mul_ref(gu))


@pytest.mark.gpu
def test_kernels_on_cuda() -> None:
    check("cuda", (torch.float32, torch.float16, torch.bfloat16))


def test_kernels_in_the_triton_interpreter() -> None:
    run_interpreted("import torch; from tests.kernels.test_elementwise_triton import "
                    "INTERPRETED_NORM_SHAPES as N, INTERPRETED_SILU_SHAPES as S, check; "
                    "check('cpu', (torch.float32, torch.float16), N, S)")
