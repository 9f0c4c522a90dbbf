"""The paged-attention reference against dense causal attention computed in float64."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention_ref, write_kv_ref
from kernels.rotary import rope_inv_freq
from stage_worker.step_input import SeqChunk, build_context


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_q: int,
                    scale: float) -> torch.Tensor:
    """q: [n_q, Hq, D] (the last n_q positions), k/v: [L, Hkv, D]; causal, float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    total = k.shape[0]
    q_pos = torch.arange(total - n_q, total)
    scores = scores.masked_fill(torch.arange(total)[None, None, :] > q_pos[None, :, None],
                                float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_mixed_batch_matches_dense(seed: int, heads: tuple[int, int]) -> None:
    """Prefill chunks (fresh and continuing) and decodes in one batch, scattered blocks."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, dim, block, num_blocks = heads[0], heads[1], 16, 4, 64
    # (computed before, new this step) per sequence: decodes, a fresh prefill, a chunk.
    shapes = [(7, 1), (0, 9), (12, 1), (5, 6), (0, 1), (30, 1)]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(num_blocks, block, hkv, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block, hkv, dim, generator=gen)
    chunks, full_k, full_v, q_parts = [], [], [], []
    for i, (done, new) in enumerate(shapes):
        total = done + new
        table = [perm.pop() for _ in range(-(-total // block))]
        chunks.append(SeqChunk(i, done, new, table))
        k = torch.randn(total, hkv, dim, generator=gen)
        v = torch.randn(total, hkv, dim, generator=gen)
        for pos in range(done):  # earlier steps' KV already in the cache
            k_cache[table[pos // block], pos % block] = k[pos]
            v_cache[table[pos // block], pos % block] = v[pos]
        full_k.append(k)
        full_v.append(v)
        q_parts.append(torch.randn(new, hq, dim, generator=gen))
    ctx = build_context(chunks, block, rope_inv_freq(dim, 10000.0), torch.device("cpu"))
    new_k = torch.cat([k[c.num_computed:] for k, c in zip(full_k, chunks, strict=True)])
    new_v = torch.cat([v[c.num_computed:] for v, c in zip(full_v, chunks, strict=True)])
    write_kv_ref(new_k, new_v, k_cache, v_cache, ctx.slot_mapping)
    scale = dim**-0.5
    out = paged_attention_ref(torch.cat(q_parts), k_cache, v_cache, ctx.attn, scale)
    want = torch.cat([dense_reference(q, k, v, q.shape[0], scale)
                      for q, k, v in zip(q_parts, full_k, full_v, strict=True)])
    # fp32 SDPA against a float64 reference over <= 31 keys: rounding ~1e-6.
    assert (out.double() - want).abs().max() < 1e-5


def test_pure_decode_batch_matches_dense() -> None:
    gen = torch.Generator().manual_seed(9)
    block, dim = 8, 32
    k_cache = torch.randn(16, block, 2, dim, generator=gen)
    v_cache = torch.randn(16, block, 2, dim, generator=gen)
    chunks = [SeqChunk(0, 10, 1, [3, 7]), SeqChunk(1, 2, 1, [11]), SeqChunk(2, 20, 1, [0, 1, 2])]
    ctx = build_context(chunks, block, rope_inv_freq(dim, 10000.0), torch.device("cpu"))
    assert ctx.attn.is_pure_decode
    q = torch.randn(3, 4, dim, generator=gen)
    out = paged_attention_ref(q, k_cache, v_cache, ctx.attn, dim**-0.5)
    for row, c in enumerate(chunks):
        total = c.num_computed + 1
        k = k_cache[list(c.block_table)].reshape(-1, 2, dim)[:total]
        v = v_cache[list(c.block_table)].reshape(-1, 2, dim)[:total]
        want = dense_reference(q[row:row + 1], k, v, 1, dim**-0.5)
        assert (out[row].double() - want[0]).abs().max() < 1e-5
