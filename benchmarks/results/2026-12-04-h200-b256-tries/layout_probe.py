# ruff: noqa: B023
"""Probe, run from the repository root on the GPU machine: the decode attention kernel alone
(llama3-8b heads, bf16, CUDA graphs, `benchmarks.attention_kernel`'s method) over KV cache
layouts. The kernel reads the cache through its strides, so a cache stored head-major
([blocks, kv_heads, block_size, D], each block's keys of one head contiguous) is passed as
its permuted view [blocks, block_size, kv_heads, D] and runs unchanged. Also the card's
read-only bandwidth (a reduction over 2 GiB) beside the copy rate the floors use.

    python benchmarks/results/2026-12-04-h200-b256-tries/layout_probe.py
"""
from __future__ import annotations

import json
import os
import statistics

import torch

from benchmarks.attention_kernel import HKV, HQ, D, graph_ms
from benchmarks.runtime_vs_hf import cuda_time_ms, roofline
from kernels.attention_launch import DECODE_LAUNCH, LaunchConfig
from kernels.paged_attention_triton import paged_attention_triton
from kernels.rotary import rope_inv_freq
from stage_worker.block_tables import BlockTables
from stage_worker.step_input import SeqChunk, build_context


def case(seqs: int, cached: int, block: int, head_major: bool):
    total = cached + 1
    per_seq = -(-total // block)
    pool = seqs * per_seq + 8
    perm = torch.randperm(pool).tolist()
    chunks = [SeqChunk(i, cached, 1, [perm.pop() for _ in range(per_seq)]) for i in range(seqs)]
    tables = BlockTables(seqs, per_seq, block, torch.device("cuda"))
    ctx = build_context(chunks, tables, rope_inv_freq(D, 500000.0).cuda(), torch.device("cuda"))
    if head_major:
        k, v = (torch.randn(pool, HKV, block, D, device="cuda", dtype=torch.bfloat16)
                .permute(0, 2, 1, 3) for _ in range(2))
    else:
        k = torch.randn(pool, block, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
    q = torch.randn(seqs, HQ, D, device="cuda", dtype=torch.bfloat16)
    return q, k, v, ctx.attn


def read_rate() -> dict[str, float]:
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    out = {}
    for name, fn in (("sum", lambda: x.sum(dtype=torch.float32)), ("amax", lambda: x.amax())):
        for _ in range(3):
            fn()
        ms = statistics.median(cuda_time_ms(fn, 10))
        out[f"read_TBps_{name}"] = x.numel() * 2 / (ms / 1e3) / 1e12
    return out


GRID = [DECODE_LAUNCH] + [LaunchConfig(16, n, w, s) for n, w, s in (
    (64, 4, 3), (64, 2, 4), (128, 4, 2), (128, 4, 3), (128, 8, 2), (32, 2, 3), (64, 2, 2))]


def main() -> None:
    roof = roofline() | read_rate()
    print(roof, flush=True)
    rows = []
    for seqs, cached in ((256, 511), (256, 519), (64, 519)):
        for block, head_major in ((16, False), (16, True), (32, True), (64, True), (64, False)):
            torch.manual_seed(0)
            q, k, v, meta = case(seqs, cached, block, head_major)
            floor = seqs * (cached + 1) * HKV * D * 4 / (roof["copy_TBps"] * 1e12) * 1e6
            rec = {"seqs": seqs, "keys": cached + 1, "block": block, "head_major": head_major,
                   "floor_us_copy": floor, "times": []}
            for lc in GRID:
                if lc.block_n < block:
                    continue
                try:
                    us = graph_ms(lambda: paged_attention_triton(
                        q, k, v, meta, D ** -0.5, splits=1, launch=lc), 20) * 1e3
                except Exception as e:
                    print("fail", lc, e)
                    continue
                rec["times"].append((round(us, 2), vars(lc)))
            rec["times"].sort(key=lambda t: t[0])
            print(json.dumps({kk: vv for kk, vv in rec.items() if kk != "times"}),
                  rec["times"][:3], flush=True)
            rows.append(rec)
    with open(os.path.join(os.environ.get("OUT", "."), "layout.json"), "w") as f:
        json.dump({"roofline": roof, "rows": rows}, f, indent=1)
    print("\nseqs keys block head_major default_us best_us floor_us(copy)")
    for r in rows:
        d = next(t[0] for t in r["times"] if t[1] == vars(DECODE_LAUNCH))
        print(r["seqs"], r["keys"], r["block"], r["head_major"], d, r["times"][0][0],
              round(r["floor_us_copy"], 1))


if __name__ == "__main__":
    main()
