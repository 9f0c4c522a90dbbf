"""The Triton paged-attention kernel alone, against its floor, over launch configurations.

    python -m benchmarks.attention_kernel --out benchmarks/results/attention-kernel-DATE.json

Cases of the llama3-8b head layout (32 query heads, 8 KV heads, head dim 128, bf16, KV
blocks of 16 scattered over the pool): decodes at batch 1 (context 512 and 4,096, with and
without split KV), 64 and 256 (context 512), and prefill chunks (1 x 4,096 and 8 x 512,
nothing cached before). For each case, every configuration of the grid
(`kernels.attention_launch.LaunchConfig`) is timed as the decode step runs it: inside
a CUDA graph (20 calls per replay, CUDA events, median of `--reps` replays, so host launch
time is not counted),
and set against the case's floor: the K/V bytes it must read over the copy rate for
decodes, its causal FLOPs over the bf16 matmul rate for prefill (both measured at the start
of the run). The kernel's defaults are marked; the best configuration of each case is what
the defaults should become.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import git_revision, print_table, write_json
from benchmarks.runtime_vs_hf import cuda_time_ms, roofline
from kernels.attention_launch import LaunchConfig, choose_launch, default_launch
from kernels.paged_attention_triton import paged_attention_triton
from kernels.rotary import rope_inv_freq
from stage_worker.block_tables import BlockTables
from stage_worker.step_input import SeqChunk, build_context

HQ, HKV, D, KV_BLOCK = 32, 8, 128, 16
# name: (sequences, tokens cached before, new tokens each, forced splits or None)
CASES = {
    "decode b1 ctx512": (1, 511, 1, None),
    "decode b1 ctx512 no split": (1, 511, 1, 1),
    "decode b1 ctx4096": (1, 4095, 1, None),
    "decode b1 ctx4096 no split": (1, 4095, 1, 1),
    "decode b16 ctx512": (16, 511, 1, None),
    "decode b64 ctx512": (64, 511, 1, None),
    "decode b256 ctx512": (256, 511, 1, None),
    "prefill 1x4096": (1, 0, 4096, None),
    "prefill 8x512": (8, 0, 512, None),
}
DECODE_GRID = [LaunchConfig(16, n, w, s) for n, w, s in
               itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3))]
PREFILL_GRID = [LaunchConfig(m, n, w, s) for m, n, w, s in
                itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]


def _case(seqs: int, cached: int, new: int, device: torch.device) -> tuple[Any, ...]:
    total = cached + new
    per_seq = -(-total // KV_BLOCK)
    pool = seqs * per_seq + 8
    perm = torch.randperm(pool).tolist()
    chunks = [SeqChunk(i, cached, new, [perm.pop() for _ in range(per_seq)])
              for i in range(seqs)]
    tables = BlockTables(seqs, per_seq, KV_BLOCK, device)
    ctx = build_context(chunks, tables, rope_inv_freq(D, 500000.0).to(device), device)
    k = torch.randn(pool, KV_BLOCK, HKV, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(seqs * new, HQ, D, device=device, dtype=torch.bfloat16)
    return q, k, v, ctx.attn


def floor_ms(seqs: int, cached: int, new: int, roof: dict[str, float]) -> float:
    total = cached + new
    if new == 1:  # every cached key and value read once per KV head
        return seqs * total * HKV * D * 2 * 2 / (roof["copy_TBps"] * 1e12) * 1e3
    pairs = seqs * (cached * new + new * (new + 1) / 2)  # causal (query, key) pairs
    return 4 * HQ * D * pairs / (roof["bf16_TFLOPs"] * 1e12) * 1e3


CALLS_PER_REPLAY = 20


def graph_ms(fn: Callable[[], object], reps: int) -> float:
    """Median device time of one call of `fn`, replayed from a CUDA graph of
    CALLS_PER_REPLAY calls (after a warm-up call outside it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_REPLAY):
            fn()
    graph.replay()
    return statistics.median(cuda_time_ms(graph.replay, reps)) / CALLS_PER_REPLAY


def run_case(name: str, seqs: int, cached: int, new: int, splits: int | None,
             roof: dict[str, float], device: torch.device, reps: int) -> dict[str, Any]:
    """Every configuration of the case's grid: its time, checked against the default's output."""
    q, k, v, meta = _case(seqs, cached, new, device)
    rows = new * HQ // HKV
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    default = (choose_launch(rows, seqs, HKV, sms)[0] if splits is None  # the kernel's pick
               else default_launch(rows, splits))

    def attend(launch: LaunchConfig) -> torch.Tensor:
        return paged_attention_triton(q, k, v, meta, D**-0.5, splits=splits, launch=launch)

    want = attend(default)
    timed = []
    for launch in DECODE_GRID if new == 1 else PREFILL_GRID:
        try:
            torch.testing.assert_close(attend(launch), want, atol=2e-2, rtol=2e-2)
            ms = graph_ms(lambda launch=launch: attend(launch), reps)
        except Exception as e:  # a configuration the card cannot run (shared memory)
            print(f"{name} {launch}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        timed.append((ms, launch))
    floor = floor_ms(seqs, cached, new, roof)
    default_ms = next(ms for ms, launch in timed if launch == default)
    best_ms, best = min(timed, key=lambda x: x[0])
    return {"case": name, "floor_ms": floor, "default_ms": default_ms,
            "default_of_floor": floor / default_ms, "best_ms": best_ms,
            "best_of_floor": floor / best_ms,
            "best": f"m{best.block_m} n{best.block_n} w{best.num_warps} s{best.num_stages}",
            "all": [{"launch": vars(launch), "ms": ms} for ms, launch in timed]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/attention-kernel-{dt.date.today()}.json"))
    args = ap.parse_args()
    device = torch.device("cuda")
    roof = roofline()
    config = {"benchmark": "Triton paged attention alone, launch configurations",
              "heads": f"{HQ}/{HKV}x{D} bf16, KV block {KV_BLOCK}",
              "card": torch.cuda.get_device_name(), "roofline": roof, "reps": args.reps,
              "revision": git_revision()}
    print(config, flush=True)
    rows = []
    for name, shape in CASES.items():
        rows.append(run_case(name, *shape, roof, device, args.reps))
        print({key: val for key, val in rows[-1].items() if key != "all"}, flush=True)
        torch.cuda.empty_cache()
    write_json(args.out, config, rows)
    print_table([{key: val for key, val in row.items() if key != "all"} for row in rows])


if __name__ == "__main__":
    main()
