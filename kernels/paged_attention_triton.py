"""Triton paged attention: one launch for a mixed batch of prefill chunks and decodes.

Same contract as `kernels.paged_attention` (shapes and causal rule in its docstring); the
torch reference there is the oracle and the CPU path. Flash-attention style: each program
owns a tile of query rows of one sequence and one KV head, walks the sequence's keys
through its block table once, `BLOCK_N` keys (several KV blocks) at a time, and keeps a
running max / sum (online softmax, fp32). Tiles are 16 rows when every sequence of the
batch has at most a few query rows (decodes), 64 when a prefill chunk has more: small
tiles keep decodes from computing padding rows, large ones keep the tensor cores busy.

Grouped-query attention is folded into the tile: row r of a tile is query token r // G and
query head (kv_head * G + r % G), G = Hq / Hkv, so the G query heads that share a KV head
read each K/V block once (decode reads every block once per KV head, not per query head).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.attention_metadata import PagedAttentionMetadata

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16  # rows (query token x head-in-group) per program; tl.dot needs >= 16
BLOCK_M_PREFILL = 64  # rows per program once some sequence has that many (prefill chunks)
BLOCK_N = 64  # keys per iteration: BLOCK_N / KV_BLOCK KV blocks


@triton.jit
def _attend_block(i, q, q_pos, kv_end, m_i, l_i, acc, K, V, table, kv_head, scale,
                  stride_kn, stride_kb, stride_kh, offs_d, d_ok,
                  KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Keys [i * BLOCK_N, (i + 1) * BLOCK_N) of the sequence, read through its block table,
    folded into the online softmax."""
    key_pos = i * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = key_pos < kv_end  # kv_end <= seq_len; later keys are causally hidden anyway
    block = tl.load(table + key_pos // KV_BLOCK, mask=key_ok, other=0).to(tl.int64)
    kv_off = (block[:, None] * stride_kn + (key_pos % KV_BLOCK)[:, None] * stride_kb
              + kv_head * stride_kh + offs_d[None, :])
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * scale
    visible = (key_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp(qk - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _paged_attention_kernel(
    Q, K, V, O, block_tables, seq_lens, query_start,
    scale,
    stride_qt, stride_qh, stride_kn, stride_kb, stride_kh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, KV_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    DYNAMIC: tl.constexpr, MAX_KV_TILES: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q0 = tl.load(query_start + seq)
    n_q = tl.load(query_start + seq + 1) - q0
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = rows // GROUP  # query token within the sequence
    if tile * BLOCK_M >= n_q * GROUP:
        return
    seq_len = tl.load(seq_lens + seq)
    head = kv_head * GROUP + rows % GROUP
    row_ok = q_idx < n_q
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM

    q_ptr = Q + (q0 + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # Row r sits at position seq_len - n_q + q_idx (rows past n_q see every key: no NaN).
    q_pos = seq_len - n_q + q_idx

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    last_q = tl.minimum(tile * BLOCK_M + BLOCK_M - 1, n_q * GROUP - 1) // GROUP
    kv_end = tl.minimum(seq_len, seq_len - n_q + last_q + 1)  # keys any row here can see
    # Compiled: loop over this sequence's keys only. Triton's interpreter cannot take a loop
    # bound from a computed value, so there the loop runs to the batch's longest sequence and
    # the keys past `kv_end` are masked out (no loads, no effect on the softmax).
    if DYNAMIC:
        for i in range(0, tl.cdiv(kv_end, BLOCK_N)):
            m_i, l_i, acc = _attend_block(
                i, q, q_pos, kv_end, m_i, l_i, acc, K, V, block_tables + seq * stride_bt,
                kv_head, scale, stride_kn, stride_kb, stride_kh, offs_d, d_ok, KV_BLOCK,
                BLOCK_N, IEEE)
    else:
        for i in range(0, MAX_KV_TILES):
            m_i, l_i, acc = _attend_block(
                i, q, q_pos, kv_end, m_i, l_i, acc, K, V, block_tables + seq * stride_bt,
                kv_head, scale, stride_kn, stride_kb, stride_kh, offs_d, d_ok, KV_BLOCK,
                BLOCK_N, IEEE)
    out = acc / l_i[:, None]
    o_ptr = O + (q0 + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]; see `kernels.paged_attention` for the contract."""
    _, num_heads, head_dim = q.shape
    _, kv_block, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    assert k_cache.stride(3) == 1 and q.stride(2) == 1, "last dimension must be contiguous"
    out = torch.empty_like(q)
    rows = meta.max_query_len * group
    block_m = BLOCK_M_PREFILL if rows >= BLOCK_M_PREFILL else BLOCK_M
    block_n = max(BLOCK_N, kv_block)
    tiles = triton.cdiv(rows, block_m)
    grid = (meta.num_seqs, kv_heads, tiles)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start,
        scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        GROUP=group, KV_BLOCK=kv_block, HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, DYNAMIC=not INTERPRETED,
        # Only the interpreter reads it; compiled, a constant avoids a compile per length.
        MAX_KV_TILES=triton.cdiv(meta.max_seq_len, block_n) if INTERPRETED else 0,
    )
    return out
