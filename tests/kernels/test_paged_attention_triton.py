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
# The interpreter (CI's CPU check) takes all but llama3-8b's, a third of its time alone;
# the GPU test takes every layout.
INTERPRETED_HEADS = ((9, 3, 64), (4, 4, 16), (6, 1, 32))


DECODES = ((0, 1), (130, 1), (63, 1), (200, 1))  # one key tile to four, split KV's cases


def check(device: str, dtype: torch.dtype, tol: float,
          splits: tuple[int | None, ...] = (None,),
          batches: tuple[tuple[tuple[int, int], ...], ...] = (MIXED, LONG, DECODES),
          heads: tuple[tuple[int, int, int], ...] = HEADS,
          kv_dtype: torch.dtype | None = None, stale: float | None = None) -> None:
    """Every head layout, the mixed, the long and the decode batch: kernel vs oracle and vs
    reference, with the split count the kernel picks (None) and each one given. A split
    count above a sequence's key tiles leaves splits empty; they must weigh nothing.
    `kv_dtype` float8_e4m3fn: an fp8 cache (the oracle sees the stored values). `stale`:
    the value of the slots no sequence wrote (NaN: the slots a sequence's last key tile
    spans past its end must not reach the output)."""
    from kernels.paged_attention_triton import paged_attention_triton

    for hq, hkv, dim in heads:
        for seed, shapes in enumerate(batches):
            case = mixed_case(seed, hq, hkv, dim, block=16, num_blocks=64, shapes=shapes,
                              dtype=dtype, device=device, kv_dtype=kv_dtype, stale=stale)
            ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta,
                                      case.scale)
            ref_err = (ref.double().cpu() - case.want).abs().max().item()
            for n in splits:
                out = paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta,
                                             case.scale, splits=n)
                err = (out.double().cpu() - case.want).abs().max().item()
                assert err < tol, (f"heads {hq}/{hkv} dim {dim} {shapes} splits {n}: {err} "
                                   f"(ref {ref_err})")


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2),
                                            (torch.float16, 5e-3)])
def test_kernel_on_cuda(dtype: torch.dtype, tol: float) -> None:
    check("cuda", dtype, tol, splits=(None, 1, 2, 3, 16))
    check("cuda", dtype, tol, splits=(None, 1, 3), batches=(MIXED, DECODES),
          stale=float("nan"))


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_kernel_over_an_fp8_cache_on_cuda(dtype: torch.dtype, tol: float) -> None:
    check("cuda", dtype, tol, splits=(None, 1, 3), kv_dtype=torch.float8_e4m3fn)
    check("cuda", dtype, tol, splits=(None, 3), batches=(DECODES,),
          kv_dtype=torch.float8_e4m3fn, stale=float("nan"))


def test_kernel_in_the_triton_interpreter() -> None:
    run_interpreted("import torch; from tests.kernels.test_paged_attention_triton import "
                    "LONG, MIXED, DECODES, INTERPRETED_HEADS as H, check; "
                    "check('cpu', torch.float32, 1e-5, batches=(MIXED, LONG), heads=H); "
                    "check('cpu', torch.float32, 1e-5, splits=(3,), batches=(DECODES,), "
                    "heads=H); "
                    "check('cpu', torch.float32, 1e-5, splits=(1, 3), batches=(DECODES,), "
                    "heads=H[:1], stale=float('nan')); "
                    "check('cpu', torch.float32, 1e-5, splits=(None, 3), batches=(MIXED,), "
                    "heads=H[:1], kv_dtype=torch.float8_e4m3fn)")


def test_split_count_follows_the_shape_only() -> None:
    """Splits only where the grid leaves SMs idle and every sequence fits one query tile;
    never more than MAX_SPLITS."""
    from kernels.attention_launch import MAX_SPLITS, kv_splits

    # batch 1 of llama3-8b (8 KV heads) on 132 SMs, 4 query rows per tile of 16
    assert kv_splits(8, 4, 16, 132) == MAX_SPLITS
    assert kv_splits(64 * 8, 4, 16, 132) == 1  # batch 64 fills the card
    assert kv_splits(96, 4, 16, 132) == 3
    assert kv_splits(8, 4096, 64, 132) == 1  # a prefill chunk: query tiles instead
