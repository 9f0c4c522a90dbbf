"""Triton argmax over each row of a [S, V] tensor (a sampler's greedy pick over the vocabulary):
the contract of `kernels.argmax.argmax_rows_ref`.

torch's argmax reduces a row in one thread block: 27-28 µs for a 128,256-token row on an H200
whatever the row count up to 64, a latency that a step at batch 1 pays in full. Here a row is
cut into `CHUNKS` ranges, one program each, which find the first largest value of their range
(tiles of BLOCK values, a strictly larger tile maximum replacing the running one, so the
earliest index wins a tie); a second kernel takes each row's first largest partial (chunks in
order, so again the earliest index). NaN counts as +inf (torch's argmax picks the first NaN;
the two differ only in a row where a +inf comes before a NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNKS = 128  # ranges per row at most (about one program per SM at batch 1)
BLOCK = 1024  # values per tile, and per range at least


@triton.jit
def _argmax_partial_kernel(X, VALS, IDX, stride_x, n_cols, chunk, n_chunks,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, n_cols)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = lo.to(tl.int64)  # an all -inf range: its first index, as torch's argmax
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < hi
        x = tl.load(X + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NaN as +inf
        m = tl.max(x, axis=0)
        i = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + start
        take = m > best
        best = tl.where(take, m, best)
        best_i = tl.where(take, i, best_i)
    tl.store(VALS + row * n_chunks + c, best)
    tl.store(IDX + row * n_chunks + c, best_i)


@triton.jit
def _argmax_final_kernel(VALS, IDX, OUT, n_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    cs = tl.arange(0, BLOCK_C)
    ok = cs < n_chunks
    vals = tl.load(VALS + row * n_chunks + cs, mask=ok, other=float("-inf"))
    m = tl.max(vals, axis=0)
    # The first chunk holding the maximum: the padding lanes lie past every real chunk.
    first = tl.min(tl.where(vals == m, cs, BLOCK_C), axis=0)
    tl.store(OUT + row, tl.load(IDX + row * n_chunks + first))


def argmax_rows_triton(x: torch.Tensor, max_chunks: int = CHUNKS, block: int = BLOCK
                       ) -> torch.Tensor:
    """x: [S, V], V >= 1, rows contiguous (stride(1) == 1); returns [S] int64. A row is cut
    in at most `max_chunks` ranges of at least `block` values (a power of two; tests lower
    both to walk several tiles per range)."""
    rows, cols = x.shape
    chunks = min(max_chunks, triton.cdiv(cols, block))
    chunk = triton.cdiv(cols, chunks)
    chunks = triton.cdiv(cols, chunk)  # no empty trailing range
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, chunks, dtype=torch.int64, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    _argmax_partial_kernel[(rows, chunks)](x, vals, idx, x.stride(0), cols, chunk, chunks,
                                           BLOCK=min(block, triton.next_power_of_2(chunk)))
    _argmax_final_kernel[(rows,)](vals, idx, out, chunks,
                                  BLOCK_C=triton.next_power_of_2(chunks))
    return out
