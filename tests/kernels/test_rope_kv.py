"""The fused rope + paged KV write kernel against the torch reference and a float64 oracle:
on CUDA (marker `gpu`), and on this machine through Triton's interpreter when triton is
installed (it is a `gpu` extra, so CI without it skips that test)."""

from __future__ import annotations

import pytest
import torch

from kernels.rope_kv import rope_and_write_kv_ref
from kernels.rotary import rope_cos_sin, rope_inv_freq
from tests.kernels.interpreter import run_interpreted

# (tokens, Hq, Hkv, D): a llama3-8b decode row, SmolLM2 batches (odd head counts), a
# prefill-sized block, one KV head with a small head.
SHAPES = ((1, 32, 8, 128), (7, 9, 3, 64), (300, 9, 3, 64), (5, 6, 1, 32))
# The interpreter (CI's CPU check) runs one program per token in Python: every layout but
# the prefill-sized block, which the GPU test keeps (nine tenths of the interpreter's time).
INTERPRETED_SHAPES = tuple(s for s in SHAPES if s[0] < 300)
BLOCK, NUM_BLOCKS = 16, 40
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _oracle(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x64[..., half:], x64[..., :half]), dim=-1)
    return x64 * cos.double()[:, None, :] + rotated * sin.double()[:, None, :]


def check(device: str, dtypes: tuple[torch.dtype, ...],
          shapes: tuple[tuple[int, int, int, int], ...] = SHAPES) -> None:
    """Every shape and dtype: rotated q, the written K and V slots, and the untouched slots."""
    from kernels.rope_kv_triton import rope_and_write_kv_triton

    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        tol = TOLERANCE[dtype]
        for tokens, hq, hkv, dim in shapes:
            # q, k, v as views of one QKV projection output, as the attention layer has them
            qkv = (torch.randn(tokens, (hq + 2 * hkv) * dim, generator=gen) * 2).to(dtype)
            q = qkv[:, :hq * dim].view(tokens, hq, dim)
            k = qkv[:, hq * dim:(hq + hkv) * dim].view(tokens, hkv, dim)
            v = qkv[:, (hq + hkv) * dim:].view(tokens, hkv, dim)
            positions = torch.randint(0, 4096, (tokens,), generator=gen)
            cos, sin = rope_cos_sin(rope_inv_freq(dim, 500000.0), positions)
            slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=gen)[:tokens]
            caches = torch.randn(2, NUM_BLOCKS, BLOCK, hkv, dim, generator=gen).to(dtype)
            ref_k, ref_v = caches[0].clone(), caches[1].clone()
            ref_q = rope_and_write_kv_ref(q, k, v, cos, sin, ref_k, ref_v, slots)
            got_k, got_v = caches[0].to(device), caches[1].to(device)
            got_q = rope_and_write_kv_triton(q.to(device), k.to(device), v.to(device),
                                             cos.to(device), sin.to(device), got_k, got_v,
                                             slots.to(device))
            what = f"{dtype} {tokens}x{hq}/{hkv}x{dim}"
            assert got_q.shape == q.shape and got_q.dtype == dtype and got_q.is_contiguous()
            for got, ref, oracle, name in (
                    (got_q.cpu(), ref_q, _oracle(q, cos, sin), "q"),
                    (got_k.cpu().flatten(0, 1)[slots], ref_k.flatten(0, 1)[slots],
                     _oracle(k, cos, sin), "k")):
                scale = max(1.0, oracle.abs().max().item())
                gap = (got.double() - ref.double()).abs().max().item()
                err = (got.double() - oracle).abs().max().item()
                ref_err = (ref.double() - oracle).abs().max().item()
                assert gap <= tol * scale, f"{what} {name}: {gap} from the reference"
                assert err <= ref_err + tol * scale, f"{what} {name}: {err} vs {ref_err}"
            assert torch.equal(got_v.cpu(), ref_v), f"{what}: v written as is"
            untouched = torch.ones(NUM_BLOCKS * BLOCK, dtype=torch.bool)
            untouched[slots] = False
            assert torch.equal(got_k.cpu().flatten(0, 1)[untouched],
                               caches[0].flatten(0, 1)[untouched]), f"{what}: other slots"
        # Outside the contract, a negative slot writes nothing (never outside the pool).
        k_cache = caches[0].to(device)
        rope_and_write_kv_triton(q.to(device), k.to(device), v.to(device), cos.to(device),
                                 sin.to(device), k_cache, k_cache, torch.full_like(slots, -1)
                                 .to(device))
        assert torch.equal(k_cache.cpu(), caches[0]), "a negative slot wrote to the pool"


@pytest.mark.gpu
def test_kernel_on_cuda() -> None:
    check("cuda", (torch.float32, torch.float16, torch.bfloat16))


def test_kernel_in_the_triton_interpreter() -> None:
    run_interpreted("import torch; from tests.kernels.test_rope_kv import "
                    "INTERPRETED_SHAPES, check; "
                    "check('cpu', (torch.float32, torch.bfloat16), INTERPRETED_SHAPES)")


def test_reference_matches_the_separate_ops_in_bf16() -> None:
    """The reference is HF's rounding: rotated q equals apply_rope_ref bit for bit."""
    from kernels.rotary import apply_rope_ref

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 6, 32, generator=gen).to(torch.bfloat16)
    k = torch.randn(4, 2, 32, generator=gen).to(torch.bfloat16)
    cos, sin = rope_cos_sin(rope_inv_freq(32, 10000.0), torch.tensor([0, 5, 9, 200]))
    k_cache = torch.zeros(2, 4, 2, 32, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([7, 0, 3, 4])
    got = rope_and_write_kv_ref(q, k, k, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(got, apply_rope_ref(q, cos, sin))
    assert torch.equal(k_cache.flatten(0, 1)[slots], apply_rope_ref(k, cos, sin))
