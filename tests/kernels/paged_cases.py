"""Paged-attention test cases: random mixed batches in scattered KV blocks, and the dense
float64 causal attention they must equal."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_attention import PagedAttentionMetadata, to_cache_dtype, write_kv_ref
from kernels.rotary import rope_inv_freq
from stage_worker.block_tables import BlockTables
from stage_worker.step_input import SeqChunk, build_context

# (computed before, new this step) per sequence: decodes, a fresh prefill, a chunk.
MIXED = ((7, 1), (0, 9), (12, 1), (5, 6), (0, 1), (30, 1))


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


@dataclass(frozen=True)
class Case:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: PagedAttentionMetadata
    scale: float
    want: torch.Tensor  # [T, Hq, D] float64, on the CPU
    cos: torch.Tensor  # [T, D] fp32: each row's rope table (the step's ForwardContext)
    sin: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64: each row's KV slot


def mixed_case(seed: int, hq: int, hkv: int, dim: int, block: int, num_blocks: int,
               shapes: tuple[tuple[int, int], ...] = MIXED, dtype: torch.dtype = torch.float32,
               device: str = "cpu", kv_dtype: torch.dtype | None = None,
               stale: float | None = None) -> Case:
    """`kv_dtype`: the caches' dtype (default `dtype`; float8_e4m3fn for an fp8 cache).
    `stale`: the value of every slot no sequence wrote (default random values), e.g. NaN,
    which must not reach any output."""
    kv_dtype = kv_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(num_blocks, block, hkv, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block, hkv, dim, generator=gen)
    if stale is not None:
        k_cache.fill_(stale)
        v_cache.fill_(stale)
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
    # Round through the test dtype (and the cache's) so the float64 oracle sees the values
    # the kernel sees.
    full_k = [to_cache_dtype(k.to(dtype), kv_dtype).to(dtype) for k in full_k]
    full_v = [to_cache_dtype(v.to(dtype), kv_dtype).to(dtype) for v in full_v]
    q_parts = [q.to(dtype) for q in q_parts]
    tables = BlockTables(len(chunks), max(len(c.block_table) for c in chunks), block,
                         torch.device(device))
    ctx = build_context(chunks, tables, rope_inv_freq(dim, 10000.0), torch.device(device))
    k_cache = to_cache_dtype(k_cache.to(dtype), kv_dtype).to(device)
    v_cache = to_cache_dtype(v_cache.to(dtype), kv_dtype).to(device)
    new_k = torch.cat([k[c.num_computed:] for k, c in zip(full_k, chunks, strict=True)])
    new_v = torch.cat([v[c.num_computed:] for v, c in zip(full_v, chunks, strict=True)])
    write_kv_ref(new_k.to(device), new_v.to(device), k_cache, v_cache, ctx.slot_mapping)
    scale = dim**-0.5
    want = torch.cat([dense_reference(q, k, v, q.shape[0], scale)
                      for q, k, v in zip(q_parts, full_k, full_v, strict=True)])
    return Case(torch.cat(q_parts).to(device), k_cache, v_cache, ctx.attn, scale, want,
                ctx.cos, ctx.sin, ctx.slot_mapping)
