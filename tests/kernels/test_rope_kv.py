"""The fused rope + paged KV write kernel against the torch reference and a float64 oracle:
on CUDA (marker `gpu`), and on this machine through Triton's interpreter when triton is
installed (it is a `gpu` extra, so CI without it skips that test)."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import to_cache_dtype
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
          shapes: tuple[tuple[int, int, int, int], ...] = SHAPES,
          kv_dtype: torch.dtype | None = None) -> None:
    """Every shape and dtype: rotated q, the written K and V slots, and the untouched slots.
    `kv_dtype` float8_e4m3fn: fp8 caches; K within one e4m3 step of the reference's (a
    rotation rounded differently can land on the other side of an e4m3 tie) and within half
    a step of the oracle, V bit for bit, values past +-448 stored saturated."""
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
            if kv_dtype is not None:  # past e4m3's range; negative values that round to -0
                v[:, 0, :3] = torch.tensor([600.0, -4e-4, -0.0], dtype=dtype)
            positions = torch.randint(0, 4096, (tokens,), generator=gen)
            cos, sin = rope_cos_sin(rope_inv_freq(dim, 500000.0), positions)
            slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=gen)[:tokens]
            caches = to_cache_dtype(torch.randn(2, NUM_BLOCKS, BLOCK, hkv, dim, generator=gen)
                                    .to(dtype), kv_dtype or dtype)
            ref_k, ref_v = caches[0].clone(), caches[1].clone()
            ref_q = rope_and_write_kv_ref(q, k, v, cos, sin, ref_k, ref_v, slots)
            got_k, got_v = caches[0].to(device), caches[1].to(device)
            got_q = rope_and_write_kv_triton(q.to(device), k.to(device), v.to(device),
                                             cos.to(device), sin.to(device), got_k, got_v,
                                             slots.to(device))
            what = f"{dtype} {tokens}x{hq}/{hkv}x{dim} cache {kv_dtype or dtype}"
            assert got_q.shape == q.shape and got_q.dtype == dtype and got_q.is_contiguous()
            written_k = got_k.cpu().flatten(0, 1)[slots]
            checked = [(got_q.cpu(), ref_q, _oracle(q, cos, sin), "q")]
            if kv_dtype is None:
                checked.append((written_k, ref_k.flatten(0, 1)[slots], _oracle(k, cos, sin),
                                "k"))
            else:
                _check_fp8_k(written_k, ref_k.flatten(0, 1)[slots], _oracle(k, cos, sin), tol,
                             what)
                assert got_v.cpu().flatten(0, 1)[slots].float().max() == 448.0, what
            for got, ref, oracle, name in checked:
                scale = max(1.0, oracle.abs().max().item())
                gap = (got.double() - ref.double()).abs().max().item()
                err = (got.double() - oracle).abs().max().item()
                ref_err = (ref.double() - oracle).abs().max().item()
                assert gap <= tol * scale, f"{what} {name}: {gap} from the reference"
                assert err <= ref_err + tol * scale, f"{what} {name}: {err} vs {ref_err}"
            assert torch.equal(_bits(got_v.cpu()), _bits(ref_v)), f"{what}: v written as is"
            untouched = torch.ones(NUM_BLOCKS * BLOCK, dtype=torch.bool)
            untouched[slots] = False
            assert torch.equal(_bits(got_k.cpu().flatten(0, 1)[untouched]),
                               _bits(caches[0].flatten(0, 1)[untouched])), f"{what}: others"
        # Outside the contract, a negative slot writes nothing (never outside the pool).
        k_cache = caches[0].to(device)
        rope_and_write_kv_triton(q.to(device), k.to(device), v.to(device), cos.to(device),
                                 sin.to(device), k_cache, k_cache, torch.full_like(slots, -1)
                                 .to(device))
        assert torch.equal(_bits(k_cache.cpu()), _bits(caches[0])), "a negative slot wrote"


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x's bytes (torch compares no fp8 tensors on the CPU)."""
    return x.contiguous().view(torch.uint8)


def _check_fp8_k(got: torch.Tensor, ref: torch.Tensor, oracle: torch.Tensor, tol: float,
                 what: str) -> None:
    """e4m3 keeps 3 mantissa bits: one step is 2^-3 of the value's power of two (2^-9 below
    2^-6, the subnormals); on top, the rotation's own rounding in q's dtype (tol x scale)."""
    got64, ref64 = got.double(), ref.double()
    step = torch.exp2(torch.floor(torch.log2(oracle.abs().clamp_min(2.0**-6))) - 3)
    slack = tol * max(1.0, oracle.abs().max().item())
    assert ((got64 - ref64).abs() <= step + slack).all(), f"{what} k: reference"
    assert ((got64 - oracle).abs() <= step / 2 + slack).all(), f"{what} k: oracle"


@pytest.mark.gpu
def test_kernel_on_cuda() -> None:
    check("cuda", (torch.float32, torch.float16, torch.bfloat16))


@pytest.mark.gpu
def test_kernel_writing_an_fp8_cache_on_cuda() -> None:
    check("cuda", (torch.float32, torch.bfloat16), kv_dtype=torch.float8_e4m3fn)


def test_kernel_in_the_triton_interpreter() -> None:
    run_interpreted("import torch; from tests.kernels.test_rope_kv import "
                    "INTERPRETED_SHAPES, check; "
                    "check('cpu', (torch.float32, torch.bfloat16), INTERPRETED_SHAPES); "
                    "check('cpu', (torch.float32, torch.bfloat16), INTERPRETED_SHAPES[:2], "
                    "kv_dtype=torch.float8_e4m3fn)")


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
