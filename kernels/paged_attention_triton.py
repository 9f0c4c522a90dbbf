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

Split KV (flash-decoding): when a decode batch gives the card fewer programs than it has
SMs (batch 1 of an 8-KV-head model is 8 programs), each tile's keys are cut into
`splits` contiguous ranges of key tiles, one program each. A program writes its unnormalised
partial (running max m, sum l, accumulator) to scratch and a second kernel merges the
splits: out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, M = max_s m_s. The number
of splits depends only on the batch's shape (sequences, KV heads, query tiles), never on
sequence lengths, so a captured CUDA graph keeps its grid; a split with no keys of its
sequence writes m = -inf, l = 0 and weighs nothing in the merge. The count is a run-time
argument (not specialised): every count shares one compiled kernel, so no step waits on a
compile for a batch size it has not seen.

Rope and the KV write folded in (`ROPE_KV`, pure decode steps, caches in q's dtype): each
program rotates its query rows on load, and the one whose key range holds a sequence's new
key rotates that k and writes k and v to their slot before it reads its keys: what
`kernels.rope_kv` then this kernel do, in one launch (16-bit caches bit for bit).

An fp8 cache (float8_e4m3fn) is passed as its bytes and widened in registers after each
load (exact): half the bytes of a bf16 cache cross the memory bus. The dots then run in fp16
(fp32 for fp32 queries), the cheapest widening of e4m3, with q converted once per program.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_launch import MAX_SPLITS, LaunchConfig, default_launch, kv_splits
from kernels.attention_metadata import PagedAttentionMetadata
from kernels.fp8_format import FP8
from kernels.platform import TRITON_INTERPRETED
from kernels.rope_kv_triton import _rope_rows, _to_cache

LOG2E = 1.4426950408889634  # the kernel's softmax runs in base 2 (exp2)


@triton.jit
def _attend_block(i, q, q_pos, kv_lo, kv_end, m_i, l_i, acc, K, V, table, kv_head, qk_scale,
                  stride_kn, stride_kb, stride_kh, offs_d, d_ok,
                  KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                  EVEN_D: tl.constexpr, MASKED: tl.constexpr, FP8_KV: tl.constexpr):
    """Keys [i * BLOCK_N, (i + 1) * BLOCK_N) of the sequence that lie in [kv_lo, kv_end),
    read through its block table, folded into the online softmax (base 2: `qk_scale` is the
    softmax scale times log2(e), m_i is in those units). Not MASKED: the caller guarantees
    every key of the tile lies in [kv_lo, kv_end) and is visible to every row (no masks).
    FP8_KV: K and V hold e4m3 bits (uint8), widened after the load (exact) to q's dtype:
    fp32 under IEEE, else fp16 (the caller passes q in fp16): e4m3 -> fp16 is one
    instruction per pair of values, where -> bf16 takes three."""
    key_pos = i * BLOCK_N + tl.arange(0, BLOCK_N)
    # kv_end <= seq_len (later keys are causally hidden anyway); kv_lo > 0 only in a split.
    if MASKED:
        key_ok = (key_pos >= kv_lo) & (key_pos < kv_end)
        block = tl.load(table + key_pos // KV_BLOCK, mask=key_ok, other=0).to(tl.int64)
    else:
        block = tl.load(table + key_pos // KV_BLOCK).to(tl.int64)
    # One base offset per key, then the head dim: [BLOCK_N] int64 math, not [BLOCK_N, D].
    key_off = block * stride_kn + (key_pos % KV_BLOCK) * stride_kb + kv_head * stride_kh
    kv_off = key_off[:, None] + offs_d[None, :]
    if MASKED:
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(K + kv_off)
        v = tl.load(V + kv_off)
    else:
        k = tl.load(K + kv_off, mask=d_ok[None, :], other=0.0)
        v = tl.load(V + kv_off, mask=d_ok[None, :], other=0.0)
    if FP8_KV:
        k = k.to(tl.float8e4nv, bitcast=True).to(q.dtype)
        v = v.to(tl.float8e4nv, bitcast=True).to(q.dtype)  # fp16 or fp32: see the caller
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * qk_scale
    if MASKED:
        visible = (key_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if MASKED:
        # A row that has seen no key yet keeps m = -inf: subtract 0 then, not -inf (no NaN).
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new  # every row saw a key of this tile: finite
    p = tl.exp2(qk - m_sub[:, None])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


# Arguments that change from step to step are not specialized (Triton otherwise compiles a
# variant per value class: == 1, divisible by 16, other): a variant first met while serving
# stalls every sequence of that step for the compile (about 0.5 s). The block-table width and
# the partials' strides follow the step's shape; the split count follows the batch.
_STEP_VARYING = ["stride_bt", "stride_ps", "stride_pt", "splits"]


@triton.jit(do_not_specialize=_STEP_VARYING)
def _paged_attention_kernel(
    Q, K, V, O, M_PART, L_PART, block_tables, seq_lens, query_start,
    qk_scale,
    stride_qt, stride_qh, stride_kn, stride_kb, stride_kh, stride_ot, stride_oh, stride_bt,
    stride_ps, stride_pt, stride_ph, splits,
    K_NEW, V_NEW, COS, SIN, SLOTS, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ct,
    GROUP: tl.constexpr, KV_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    EVEN_D: tl.constexpr, DYNAMIC: tl.constexpr, MAX_KV_TILES: tl.constexpr, SPLIT: tl.constexpr,
    FP8_KV: tl.constexpr, ROPE_KV: tl.constexpr,
):
    """One (sequence, KV head, query tile, key range) per program, `splits` ranges per tile.
    Not SPLIT (splits == 1): O is the output [T, Hq, D]. SPLIT: O is the fp32 accumulator
    scratch [splits, T, Hq, D] and M_PART / L_PART [splits, T, Hq] take each row's running
    max and sum (`_merge_splits_kernel`). ROPE_KV (every sequence one query row, D a power
    of two): Q, K_NEW, V_NEW are the step's q, k, v before rope; COS / SIN [T, D] the rope
    tables of each row's position, SLOTS [T] each row's KV slot (< 0: nothing written)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Last query tiles first: under the causal rule they read the most keys, and starting
    # them first keeps the launch's tail short.
    order = tl.num_programs(2) - 1 - tl.program_id(2)
    tile = order // splits
    split = order % splits
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
    if ROPE_KV:  # one query row per sequence: row q0, the sequence's new token
        half: tl.constexpr = HEAD_DIM // 2
        upper = offs_d >= half
        partner = tl.where(upper, offs_d - half, offs_d + half)
        rope_dtype = q.dtype
        cos = tl.load(COS + q0.to(tl.int64) * stride_ct + offs_d).to(rope_dtype).to(tl.float32)
        sin = tl.load(SIN + q0.to(tl.int64) * stride_ct + offs_d).to(rope_dtype).to(tl.float32)
        q_partner = tl.load(q_ptr - offs_d[None, :] + partner[None, :], mask=row_ok[:, None],
                            other=0.0)
        q = _rope_rows(q, q_partner, cos[None, :], sin[None, :], upper[None, :], rope_dtype)
    if FP8_KV and not IEEE:
        # fp16 dots over the widened e4m3 K/V: q's 16-bit values are exact in fp16 within
        # its range (bf16 has fewer mantissa bits), clamped to it (a query past 65504 would
        # be inf); the products sum in fp32 as before.
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    # Row r sits at position seq_len - n_q + q_idx (rows past n_q see every key: no NaN).
    q_pos = seq_len - n_q + q_idx

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    last_q = tl.minimum(tile * BLOCK_M + BLOCK_M - 1, n_q * GROUP - 1) // GROUP
    kv_end = tl.minimum(seq_len, seq_len - n_q + last_q + 1)  # keys any row here can see
    # This program's key tiles: [tile_lo, tile_hi) of the sequence's cdiv(kv_end, BLOCK_N).
    n_tiles = tl.cdiv(kv_end, BLOCK_N)
    per_split = tl.cdiv(n_tiles, splits)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, n_tiles)
    kv_lo = tile_lo * BLOCK_N
    kv_hi = tl.minimum(kv_end, tile_hi * BLOCK_N)
    # Key tiles below `full_hi` hold only keys every row sees (keys up to the tile's first
    # row's position, which is below kv_hi): no masks there; the rest (the causal diagonal
    # and the sequence's last partial tile) are masked.
    full_hi = tl.maximum(tl.minimum(tile_hi, (seq_len - n_q + tile * BLOCK_M // GROUP + 1)
                                    // BLOCK_N), tile_lo)
    table = block_tables + seq * stride_bt
    if ROPE_KV:
        slot = tl.load(SLOTS + q0).to(tl.int64)
        # The new key is the sequence's last: the program whose range holds its tile writes
        # it (one per sequence and KV head), then reads it back with the others below.
        if ((n_tiles - 1) // per_split == split) & (slot >= 0):
            k_row = K_NEW + q0.to(tl.int64) * stride_knt + kv_head * stride_knh
            v_row = V_NEW + q0.to(tl.int64) * stride_vnt + kv_head * stride_vnh
            k_new = _rope_rows(tl.load(k_row + offs_d), tl.load(k_row + partner), cos, sin,
                               upper, rope_dtype)
            at = (slot // KV_BLOCK) * stride_kn + (slot % KV_BLOCK) * stride_kb \
                + kv_head * stride_kh + offs_d
            tl.store(K + at, _to_cache(k_new, K.dtype.element_ty, FP8_KV))
            tl.store(V + at, _to_cache(tl.load(v_row + offs_d), V.dtype.element_ty, FP8_KV))
        tl.debug_barrier()  # every thread's part of the write before any thread reads keys
    # Compiled: loop over this program's keys only. Triton's interpreter cannot take a loop
    # bound from a computed value, so there the loop runs to the batch's longest sequence and
    # each tile takes the path the compiled loops would give it.
    if DYNAMIC:
        for i in range(tile_lo, full_hi):
            m_i, l_i, acc = _attend_block(
                i, q, q_pos, kv_lo, kv_hi, m_i, l_i, acc, K, V, table, kv_head, qk_scale,
                stride_kn, stride_kb, stride_kh, offs_d, d_ok, KV_BLOCK, BLOCK_N, IEEE,
                EVEN_D, False, FP8_KV)
        for i in range(full_hi, tile_hi):
            m_i, l_i, acc = _attend_block(
                i, q, q_pos, kv_lo, kv_hi, m_i, l_i, acc, K, V, table, kv_head, qk_scale,
                stride_kn, stride_kb, stride_kh, offs_d, d_ok, KV_BLOCK, BLOCK_N, IEEE,
                EVEN_D, True, FP8_KV)
    else:
        for i in range(0, MAX_KV_TILES):
            if (i >= tile_lo) & (i < full_hi):
                m_i, l_i, acc = _attend_block(
                    i, q, q_pos, kv_lo, kv_hi, m_i, l_i, acc, K, V, table, kv_head, qk_scale,
                    stride_kn, stride_kb, stride_kh, offs_d, d_ok, KV_BLOCK, BLOCK_N, IEEE,
                    EVEN_D, False, FP8_KV)
            else:
                m_i, l_i, acc = _attend_block(
                    i, q, q_pos, kv_lo, kv_hi, m_i, l_i, acc, K, V, table, kv_head, qk_scale,
                    stride_kn, stride_kb, stride_kh, offs_d, d_ok, KV_BLOCK, BLOCK_N, IEEE,
                    EVEN_D, True, FP8_KV)
    out_mask = row_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        out = acc / l_i[:, None]
        o_ptr = (O + (q0 + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh
                 + offs_d[None, :])
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=out_mask)
    else:
        part = split * stride_ps + (q0 + q_idx) * stride_pt + head * stride_ph
        tl.store(M_PART + part, m_i, mask=row_ok)
        tl.store(L_PART + part, l_i, mask=row_ok)
        o_ptr = (O + split * stride_ps * HEAD_DIM + (q0 + q_idx)[:, None] * stride_pt * HEAD_DIM
                 + head[:, None] * stride_ph * HEAD_DIM + offs_d[None, :])
        tl.store(o_ptr, acc, mask=out_mask)


@triton.jit(do_not_specialize=["stride_ps", "stride_pt", "splits"])
def _merge_splits_kernel(ACC, M_PART, L_PART, O, stride_ps, stride_pt, stride_ph,
                         stride_ot, stride_oh, splits,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
    """One (query row, head) per program: O = sum_s w_s acc_s / sum_s w_s l_s with
    w_s = 2^(m_s - max m). Split 0 always holds key 0, so max m is finite."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    s_ok = s < splits
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    part = s * stride_ps + t * stride_pt + h * stride_ph
    m = tl.load(M_PART + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(L_PART + part, mask=s_ok, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # m in base-2 units (`_attend_block`)
    acc = tl.load(ACC + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(O + t * stride_ot + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_ok)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass(frozen=True)
class NewKV:
    """A pure decode step's k and v before rope, with what rotating and writing them needs
    (`kernels.rope_kv`'s contract): k, v [T, Hkv, D] (rows may be strided, the last
    dimension contiguous), cos, sin [T, D] fp32, slot_mapping [T] int64."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    splits: int | None = None,
    launch: LaunchConfig | None = None,
    new: NewKV | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]; see `kernels.paged_attention` for the contract.

    `splits` (key ranges per tile, split KV) is chosen by `kv_splits` from the batch's shape
    and the card's SM count, and `launch` is DECODE_LAUNCH (SPLIT_DECODE_LAUNCH when split)
    or PREFILL_LAUNCH by the longest query, unless given (tests and
    `benchmarks.attention_kernel` set them).

    `new`: a pure decode step whose q is before rope; its k and v are rotated and written
    here, in the same launch (`kernels.rope_kv.rope_kv_decode_attention`; D a power of two,
    the cache in q's dtype)."""
    num_tokens, num_heads, head_dim = q.shape
    _, kv_block, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    assert k_cache.stride(3) == 1 and q.stride(2) == 1, "last dimension must be contiguous"
    if new is not None:
        assert meta.is_pure_decode and head_dim & (head_dim - 1) == 0, "decode, D = 2^n"
        # On the H200 an fp8 cache written this way differed from rope_kv's kernel for 8 KV
        # heads of 128 (the cause not found): fp8 caches keep the two launches.
        assert k_cache.dtype != FP8, "an fp8 cache takes rope_and_write_kv, then attention"
        assert new.k.stride(2) == 1 and new.v.stride(2) == 1 and new.cos.stride(1) == 1
        assert new.sin.stride() == new.cos.stride()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    fp8_kv = k_cache.dtype == FP8
    if fp8_kv:  # the bits, widened in the kernel (Triton's interpreter has no fp8 arrays)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    rows = meta.max_query_len * group
    block_m = launch.block_m if launch is not None else default_launch(rows, 1).block_m
    tiles = triton.cdiv(rows, block_m)
    if splits is None:
        splits = (1 if TRITON_INTERPRETED else
                  kv_splits(meta.num_seqs * kv_heads * tiles, rows, block_m,
                            _sm_count(q.device.index or 0)))
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    if launch is None:
        launch = default_launch(rows, splits)  # block_m as above
    block_n = max(launch.block_n, kv_block)
    if splits > 1:  # fp32 partials, row (split, token, head); the merge writes `out`
        m_part = torch.empty(splits, num_tokens, num_heads, dtype=torch.float32,
                             device=q.device)
        l_part = torch.empty_like(m_part)
        acc = torch.empty(splits, num_tokens, num_heads, head_dim, dtype=torch.float32,
                          device=q.device)
        target, part_strides = acc, m_part.stride()
    else:
        m_part = l_part = target = out
        part_strides = (0, 0, 0)
    grid = (meta.num_seqs, kv_heads, tiles * splits)
    d_pad = triton.next_power_of_2(head_dim)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, target, m_part, l_part, meta.block_tables, meta.seq_lens,
        meta.query_start, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), meta.block_tables.stride(0), *part_strides, splits,
        *((new.k, new.v, new.cos, new.sin, new.slot_mapping, new.k.stride(0), new.k.stride(1),
           new.v.stride(0), new.v.stride(1), new.cos.stride(0)) if new is not None else
          (q, q, q, q, q, 0, 0, 0, 0, 0)),
        GROUP=group, KV_BLOCK=kv_block, HEAD_DIM=head_dim,
        D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, EVEN_D=d_pad == head_dim, DYNAMIC=not TRITON_INTERPRETED,
        # Only the interpreter reads it; compiled, a constant avoids a compile per length.
        MAX_KV_TILES=triton.cdiv(meta.max_seq_len, block_n) if TRITON_INTERPRETED else 0,
        SPLIT=splits > 1, FP8_KV=fp8_kv, ROPE_KV=new is not None, num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            acc, m_part, l_part, out, *part_strides, out.stride(0), out.stride(1), splits,
            HEAD_DIM=head_dim, D_PAD=d_pad, S_PAD=MAX_SPLITS)
    return out
