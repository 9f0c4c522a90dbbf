"""The paged-attention reference against dense causal attention computed in float64."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention_ref
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
