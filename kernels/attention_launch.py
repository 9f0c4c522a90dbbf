"""How the Triton paged attention kernel (`kernels.paged_attention_triton`) is launched for a
step: tile sizes, warps and pipeline stages, and how many ranges a tile's keys are split in
(split KV, flash-decoding). Pure Python and a function of the batch's shape only (never of
sequence lengths), so the runner's warm-up, the benchmarks and the tests name the launch a
step gets without importing Triton."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch parameters of one launch.

    block_m: rows (query token x head-in-group) per program; tl.dot needs >= 16.
    block_n: keys per iteration (block_n / KV block size KV blocks; at least one block).
    num_warps, num_stages: Triton's; stages > 1 pipeline the key loop's loads.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3


# Chosen by `benchmarks.attention_kernel` on an H200 (llama3-8b heads, bf16): within 1 % of
# the best of its grid at decode batch 64 and 256; for prefill chunks the best at 1 x 4,096
# and 8 x 512 (128 rows: 32 tokens of a 4-head group; 10 % faster than 64 rows with 4
# warps). A decode launch whose keys are split (few sequences) takes SPLIT_DECODE_LAUNCH:
# each program reads a few tiles only, so more warps beat a deeper pipeline (batch 1:
# 5.9 against 6.9 us at context 512, 10.5 against 11.0 at 4,096).
DECODE_LAUNCH = LaunchConfig(block_m=16, block_n=64, num_warps=2, num_stages=3)
SPLIT_DECODE_LAUNCH = LaunchConfig(block_m=16, block_n=64, num_warps=4, num_stages=1)
PREFILL_LAUNCH = LaunchConfig(block_m=128, block_n=32, num_warps=8, num_stages=2)
MAX_SPLITS = 16  # key ranges per tile at most (split KV)
PROGRAMS_PER_SM = 2  # split until the grid has about this many programs per SM


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_splits(programs: int, query_rows: int, block_m: int, sm_count: int) -> int:
    """Key ranges per tile for a launch of `programs` (sequence, KV head, tile) programs:
    1 unless every sequence fits one query tile (decodes) and the grid would leave SMs idle;
    then enough to give about PROGRAMS_PER_SM programs per SM, at most MAX_SPLITS. Sequence
    lengths play no part (a graph replays one grid for every length): the splits past a
    short sequence's keys find nothing to read and exit."""
    if query_rows > block_m or programs >= sm_count:
        return 1
    want = _cdiv(PROGRAMS_PER_SM * sm_count, programs)
    return max(1, min(MAX_SPLITS, want))


def default_launch(rows: int, splits: int) -> LaunchConfig:
    """The launch for a step whose longest query has `rows` rows (tokens x heads per KV
    head) and whose keys are cut in `splits` ranges: PREFILL_LAUNCH from its block_m rows,
    else DECODE_LAUNCH, or SPLIT_DECODE_LAUNCH where the keys are split (both decode
    launches have one block_m, so `kv_splits` may be asked with either)."""
    if rows >= PREFILL_LAUNCH.block_m:
        return PREFILL_LAUNCH
    return SPLIT_DECODE_LAUNCH if splits > 1 else DECODE_LAUNCH


def choose_launch(rows: int, num_seqs: int, kv_heads: int, sm_count: int
                  ) -> tuple[LaunchConfig, int]:
    """(launch, splits) as `paged_attention_triton` picks them when given neither, for a
    step of `num_seqs` sequences whose longest query has `rows` rows."""
    block_m = default_launch(rows, 1).block_m  # one block_m for both decode launches
    splits = kv_splits(num_seqs * kv_heads * _cdiv(rows, block_m), rows, block_m, sm_count)
    return default_launch(rows, splits), splits
