"""Causal attention over a paged KV cache, for a mixed batch of prefill chunks and decodes.

Layout contract (shared by the torch reference here and the Triton kernel that replaces it):
    q:            [T, Hq, D]      the batch's new tokens, sequences concatenated
    k/v_cache:    [N, B, Hkv, D]  one layer's pool: N blocks of B token slots (this rank's heads),
                                  in the model's dtype or float8_e4m3fn (an fp8 KV cache:
                                  values stored at unit scale, saturated to +-448, widened
                                  to q's dtype when read)
    block_tables: [S, M] int32    block ids of each sequence; entries past ceil(seq_len / B)
                                  are never read (-1, or any id a table row held before)
    seq_lens:     [S]             tokens of each sequence in the cache *including* this step's
    query_start:  [S + 1]         q rows of sequence s are query_start[s]:query_start[s+1]
The new tokens' K/V must already be written to the cache. Query row i of sequence s sits at
position seq_lens[s] - q_len[s] + i and attends keys 0..that position (causal).
Hq must be a multiple of Hkv (grouped-query attention: q head h reads kv head h // (Hq/Hkv)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_metadata import PagedAttentionMetadata
from kernels.fp8_format import FP8, FP8_MAX
from kernels.platform import PLATFORM

__all__ = ["PagedAttentionMetadata", "paged_attention", "paged_attention_ref", "to_cache_dtype",
           "uses_triton_kernel", "write_kv_ref"]


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new k/v [T, Hkv, D] into the caches at flat slots (block * B + offset) [T]."""
    num_blocks, block_size, heads, dim = k_cache.shape
    k_cache.view(num_blocks * block_size, heads, dim)[slot_mapping] = to_cache_dtype(
        k, k_cache.dtype)
    v_cache.view(num_blocks * block_size, heads, dim)[slot_mapping] = to_cache_dtype(
        v, v_cache.dtype)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: a plain cast, or for an fp8 cache x saturated to e4m3's
    range (+-448) and rounded to nearest even (unit scale)."""
    if dtype == FP8:
        return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x.to(dtype)


def uses_triton_kernel(device: torch.device, block_size: int, head_dim: int) -> bool:
    """Whether `paged_attention` runs the Triton kernel: on CUDA when the platform uses Triton
    and the layout suits it (KV block size a power of two >= 16, head dim >= 16)."""
    return (device.type == "cuda" and PLATFORM.use_triton and block_size >= 16
            and block_size & (block_size - 1) == 0 and head_dim >= 16)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The step's attention: the Triton kernel where `uses_triton_kernel`, else the reference."""
    if uses_triton_kernel(q.device, k_cache.shape[1], k_cache.shape[3]):
        from kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Reference paged attention; returns [T, Hq, D] in q's dtype (softmax in fp32 via SDPA)."""
    if meta.is_pure_decode:
        return _decode_batched(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    out = torch.empty_like(q)
    if meta.decode_seqs:
        assert meta.decode_rows is not None and meta.decode_index is not None
        idx = meta.decode_index
        out[meta.decode_rows] = _decode_batched(
            q[meta.decode_rows], k_cache, v_cache, meta.block_tables[idx], meta.seq_lens[idx],
            scale)
    block_size = k_cache.shape[1]
    for s in meta.prefill_seqs or range(meta.num_seqs):
        q0, q1 = meta.query_start_host[s], meta.query_start_host[s + 1]
        seq_len = meta.seq_lens_host[s]
        n_blocks = -(-seq_len // block_size)
        blocks = meta.block_tables[s, :n_blocks].long()
        k = _gather(k_cache, blocks, seq_len)  # [L, Hkv, D]
        v = _gather(v_cache, blocks, seq_len)
        n_q = q1 - q0
        # Query i sits at position seq_len - n_q + i; keys j <= that position are visible.
        q_pos = torch.arange(seq_len - n_q, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [n_q, L]
        out[q0:q1] = _sdpa(q[q0:q1], k, v, mask, scale)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    heads, dim = cache.shape[2], cache.shape[3]
    return cache[blocks].reshape(-1, heads, dim)[:seq_len]


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [n, Hq, D], k/v: [L, Hkv, D], mask: [n, L] bool -> [n, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.to(q.dtype).repeat_interleave(group, dim=1)
    v = v.to(q.dtype).repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def _decode_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [S, Hq, D], one query token per sequence: one padded SDPA call over [S, M*B] keys."""
    num_seqs, max_blocks = block_tables.shape
    _, block_size, heads, dim = k_cache.shape
    blocks = block_tables.long().clamp_min(0)  # padding reads block 0, masked below
    k = k_cache[blocks].reshape(num_seqs, max_blocks * block_size, heads, dim)
    v = v_cache[blocks].reshape(num_seqs, max_blocks * block_size, heads, dim)
    group = q.shape[1] // heads
    k = k.to(q.dtype).repeat_interleave(group, dim=2).transpose(1, 2)  # [S, Hq, L, D]
    v = v.to(q.dtype).repeat_interleave(group, dim=2).transpose(1, 2)
    key_pos = torch.arange(max_blocks * block_size, device=q.device)
    mask = key_pos[None, :] < seq_lens.to(q.device)[:, None]  # [S, L]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], scale=scale
    )  # [S, Hq, 1, D]
    return out[:, :, 0, :]
