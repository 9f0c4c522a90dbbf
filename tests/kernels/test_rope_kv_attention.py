"""Rope, the KV write and decode attention in one Triton launch against the two kernels it
replaces and the torch references: on CUDA (marker `gpu`), and on this machine through
Triton's interpreter when triton is installed (a `gpu` extra, so CI without it skips it).

The caches: in 16-bit dtypes the fused launch writes the reference's values bit for bit
(on the H200 rope_kv's own kernel is a rounding step off on some elements there, within
its test's tolerance); in fp32 it writes what rope_kv's kernel writes (both within fp32
rounding of the reference). The output: within the dtype's tolerance of the references."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention_ref
from kernels.rope_kv import rope_and_write_kv_ref, rope_kv_decode_attention
from tests.kernels.interpreter import run_interpreted
from tests.kernels.paged_cases import mixed_case

# Decodes (computed before, 1 new): one key tile to several, a first token, a sequence
# whose new key opens a KV block; split KV spreads them over up to 16 key ranges.
DECODES = ((0, 1), (130, 1), (63, 1), (200, 1), (16, 1), (47, 1))
# (Hq, Hkv, D): llama3-8b, SmolLM2-135M, one KV head with a small head.
HEADS = ((32, 8, 128), (9, 3, 64), (6, 1, 32))
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check(device: str, dtype: torch.dtype, splits: tuple[int | None, ...],
          heads: tuple[tuple[int, int, int], ...] = HEADS) -> None:
    """For each head layout and split count: the fused launch against rope_and_write_kv's
    kernel followed by the attention kernel and against the references (module docstring)."""
    from kernels.paged_attention_triton import NewKV, paged_attention_triton
    from kernels.rope_kv_triton import rope_and_write_kv_triton

    for seed, (hq, hkv, dim) in enumerate(heads):
        case = mixed_case(seed, hq, hkv, dim, block=16, num_blocks=64, shapes=DECODES,
                          dtype=dtype, device=device)
        tokens = case.q.shape[0]
        gen = torch.Generator().manual_seed(seed)
        # q, k, v before rope as views of one QKV projection output, as the layer has them
        qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=gen).to(dtype).to(device)
        q = qkv[:, :hq * dim].view(tokens, hq, dim)
        k = qkv[:, hq * dim:(hq + hkv) * dim].view(tokens, hkv, dim)
        v = qkv[:, (hq + hkv) * dim:].view(tokens, hkv, dim)
        cos, sin = case.cos.to(device), case.sin.to(device)
        slots = case.slot_mapping.to(device)

        # The references on the CPU: the same case (same seed) with its layout there.
        host = mixed_case(seed, hq, hkv, dim, block=16, num_blocks=64, shapes=DECODES,
                          dtype=dtype)
        ref_k, ref_v = host.k_cache.clone(), host.v_cache.clone()
        q_rot = rope_and_write_kv_ref(q.cpu(), k.cpu(), v.cpu(), host.cos, host.sin, ref_k,
                                      ref_v, host.slot_mapping)
        ref = paged_attention_ref(q_rot, ref_k, ref_v, host.meta, host.scale)
        for n in splits:
            two_k, two_v = case.k_cache.clone(), case.v_cache.clone()
            two = paged_attention_triton(
                rope_and_write_kv_triton(q, k, v, cos, sin, two_k, two_v, slots), two_k, two_v,
                case.meta, case.scale, splits=n)
            one_k, one_v = case.k_cache.clone(), case.v_cache.clone()
            one = paged_attention_triton(q, one_k, one_v, case.meta, case.scale, splits=n,
                                         new=NewKV(k, v, cos, sin, slots))
            where = f"{dtype} heads {hq}/{hkv} dim {dim} splits {n}"
            want_k, want_v = (two_k, two_v) if dtype == torch.float32 else (ref_k, ref_v)
            assert torch.equal(one_k.cpu(), want_k.cpu()), where
            assert torch.equal(one_v.cpu(), want_v.cpu()), where
            for out in (one, two):
                err = (out.cpu().double() - ref.double()).abs().max().item()
                assert err < TOLERANCE[dtype], (where, err)


def test_the_dispatcher_takes_the_references_off_cuda() -> None:
    """On CPU `rope_kv_decode_attention` is rope_and_write_kv's reference then attention's."""
    case = mixed_case(0, 9, 3, 64, block=16, num_blocks=64, shapes=DECODES)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(case.q.shape[0], h, 64, generator=gen) for h in (9, 3, 3))
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    want = paged_attention_ref(
        rope_and_write_kv_ref(q, k, v, case.cos, case.sin, ref_k, ref_v, case.slot_mapping),
        ref_k, ref_v, case.meta, case.scale)
    got = rope_kv_decode_attention(q, k, v, case.cos, case.sin, case.k_cache, case.v_cache,
                                   case.slot_mapping, case.meta, case.scale)
    assert torch.equal(got, want)
    assert torch.equal(case.k_cache, ref_k) and torch.equal(case.v_cache, ref_v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_launch_on_cuda(dtype: torch.dtype) -> None:
    check("cuda", dtype, splits=(None, 1, 2, 3, 16))


@pytest.mark.gpu
def test_an_fp8_cache_keeps_the_two_launches() -> None:
    """The fused launch takes caches in q's dtype only; the dispatcher sends an fp8 cache
    through rope_and_write_kv and the attention kernel."""
    from kernels.paged_attention_triton import NewKV, paged_attention_triton

    case = mixed_case(0, 32, 8, 128, block=16, num_blocks=64, shapes=DECODES,
                      dtype=torch.bfloat16, device="cuda", kv_dtype=torch.float8_e4m3fn)
    q, k, v = (torch.randn(case.q.shape[0], h, 128, dtype=torch.bfloat16, device="cuda")
               for h in (32, 8, 8))
    with pytest.raises(AssertionError, match="fp8 cache"):
        paged_attention_triton(q, case.k_cache, case.v_cache, case.meta, case.scale,
                               new=NewKV(k, v, case.cos, case.sin, case.slot_mapping))
    got = rope_kv_decode_attention(q, k, v, case.cos, case.sin, case.k_cache, case.v_cache,
                                   case.slot_mapping, case.meta, case.scale)
    assert got.shape == q.shape and bool(got.isfinite().all())


def test_fused_launch_in_the_triton_interpreter() -> None:
    run_interpreted("import torch; from tests.kernels.test_rope_kv_attention import HEADS, check; "
                    "check('cpu', torch.float32, splits=(1, 3), heads=HEADS[1:])")
