"""The Triton paged-attention kernel against the float64 dense oracle and the torch reference:
on CUDA (marker `gpu`), and on this machine through Triton's interpreter when triton is
installed (it is a `gpu` extra, so CI without it skips that test)."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention_ref
from tests.kernels.interpreter import run_interpreted
from tests.kernels.paged_cases import MIXED, mixed_case

LONG = ((40, 1), (0, 37), (20, 20), (3, 1), (64, 1), (70, 30))  # several KV blocks, key
# tiles and query tiles (small and prefill-sized)
# (Hq, Hkv, D): SmolLM2-135M, llama3-8b, MHA with a small head, one KV head.
HEADS = ((9, 3, 64), (32, 8, 128), (4, 4, 16), (6, 1, 32))


def check(device: str, dtype: torch.dtype, tol: float) -> None:
    """Every head layout, the mixed and the long batch: kernel vs oracle and vs reference."""
    from kernels.paged_attention_triton import paged_attention_triton

    for hq, hkv, dim in HEADS:
        for seed, shapes in enumerate((MIXED, LONG)):
            case = mixed_case(seed, hq, hkv, dim, block=16, num_blocks=64, shapes=shapes,
                              dtype=dtype, device=device)
            out = paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta,
                                         case.scale)
            ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta,
                                      case.scale)
            err = (out.double().cpu() - case.want).abs().max().item()
            ref_err = (ref.double().cpu() - case.want).abs().max().item()
            assert err < tol, f"heads {hq}/{hkv} dim {dim} {shapes}: {err} (ref {ref_err})"


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2),
                                            (torch.float16, 5e-3)])
def test_kernel_on_cuda(dtype: torch.dtype, tol: float) -> None:
    check("cuda", dtype, tol)


def test_kernel_in_the_triton_interpreter() -> None:
    run_interpreted("import torch; from tests.kernels.test_paged_attention_triton import check; "
                    "check('cpu', torch.float32, 1e-5)")
