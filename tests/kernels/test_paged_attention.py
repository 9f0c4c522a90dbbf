"""The paged-attention reference against dense causal attention computed in float64."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention_ref, write_kv_ref
from kernels.rotary import rope_inv_freq
from stage_worker.block_tables import BlockTables
from stage_worker.step_input import SeqChunk, build_context
from tests.kernels.paged_cases import dense_reference, mixed_case


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_mixed_batch_matches_dense(seed: int, heads: tuple[int, int]) -> None:
    """Prefill chunks (fresh and continuing) and decodes in one batch, scattered blocks."""
    case = mixed_case(seed, heads[0], heads[1], dim=16, block=4, num_blocks=64)
    out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    # fp32 SDPA against a float64 reference over <= 31 keys: rounding ~1e-6.
    assert (out.double() - case.want).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_matches_dense_over_the_stored_values(dtype: torch.dtype) -> None:
    """An fp8 KV cache: the reference widens the stored e4m3 values exactly, so it equals
    dense attention over those values (the oracle's K/V are rounded through e4m3 too)."""
    case = mixed_case(3, 8, 2, dim=16, block=4, num_blocks=64, dtype=dtype,
                      kv_dtype=torch.float8_e4m3fn)
    assert case.k_cache.dtype == torch.float8_e4m3fn
    out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.dtype == dtype
    assert (out.double() - case.want).abs().max() < (1e-5 if dtype == torch.float32 else 3e-2)


def test_fp8_cache_writes_saturate_and_round_to_nearest_even() -> None:
    """Values past e4m3's range are stored as +-448 (not NaN); the rest round to nearest
    even, as torch's own cast does."""
    cache = torch.zeros(2, 4, 1, 4, dtype=torch.float8_e4m3fn)
    k = torch.tensor([[[1000.0, -1e6, 448.0, 0.30]], [[1.0625, 1.1875, -3.0, 5e-4]]])
    write_kv_ref(k, k, cache, cache.clone(), torch.tensor([5, 2]))
    stored = cache.flatten(0, 1).float()
    assert stored[5, 0].tolist()[:3] == [448.0, -448.0, 448.0]
    assert stored[2, 0].tolist()[:3] == [1.0, 1.25, -3.0]  # ties to even: 1.0625 -> 1.0
    assert torch.equal(cache.flatten(0, 1)[[5, 2]], k.to(torch.float8_e4m3fn))
    assert not stored.isnan().any()


def test_pure_decode_batch_matches_dense() -> None:
    gen = torch.Generator().manual_seed(9)
    block, dim = 8, 32
    k_cache = torch.randn(16, block, 2, dim, generator=gen)
    v_cache = torch.randn(16, block, 2, dim, generator=gen)
    chunks = [SeqChunk(0, 10, 1, [3, 7]), SeqChunk(1, 2, 1, [11]), SeqChunk(2, 20, 1, [0, 1, 2])]
    ctx = build_context(chunks, BlockTables(4, 4, block, torch.device("cpu")),
                        rope_inv_freq(dim, 10000.0), torch.device("cpu"))
    assert ctx.attn.is_pure_decode
    q = torch.randn(3, 4, dim, generator=gen)
    out = paged_attention_ref(q, k_cache, v_cache, ctx.attn, dim**-0.5)
    for row, c in enumerate(chunks):
        total = c.num_computed + 1
        k = k_cache[list(c.block_table)].reshape(-1, 2, dim)[:total]
        v = v_cache[list(c.block_table)].reshape(-1, 2, dim)[:total]
        want = dense_reference(q[row:row + 1], k, v, 1, dim**-0.5)
        assert (out[row].double() - want[0]).abs().max() < 1e-5
