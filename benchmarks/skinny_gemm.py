"""Linear layers at decode batch sizes (few rows), dense bf16 weights: cuBLAS through
F.linear, cuBLASLt, and the weight-streaming Triton kernel the layers run
(`kernels.skinny_linear_triton`) with its default launch and the best of a grid of launches
(split K included), each against the weight-streaming floor (weight bytes / the copy rate
measured in the same run). The merged gate/up projection is timed twice more: cuBLAS then
the SiLU-and-mul kernel, against the streaming kernel with the SiLU-and-mul in its
epilogue (what `kernels.linear.linear_silu_and_mul` runs).

Every case runs inside a CUDA graph over enough distinct weight copies (>= 512 MB) that
nothing is served from L2, as in a real step where each layer's weight is read once.
Usage (on the GPU machine):

    python -m benchmarks.skinny_gemm --shape llama3-8b --rows 1,4,16 --out skinny_gemm.json
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from benchmarks.report import git_revision, print_table, write_json
from benchmarks.runtime_vs_hf import cuda_time_ms, roofline
from benchmarks.shapes import SHAPES
from kernels.activation import silu_and_mul
from kernels.skinny_linear_triton import SkinnyLaunch, skinny_launch, skinny_linear_triton

GRID = [SkinnyLaunch(n, k, w, s, split) for n, k, w, s, split in
        itertools.product((32, 64), (128, 256), (4,), (3, 4), (1, 2, 4, 8))]
# `--wide`: narrower and deeper tiles, more warps and stages, little split (batch 1).
WIDE_GRID = [SkinnyLaunch(n, k, w, s, split) for n, k, w, s, split in
             itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4, 5), (1, 2))]


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """(out, in) features of each linear layer of a decoder layer, TP 1."""
    c = SHAPES[shape]
    hidden, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = hidden // heads
    return {"qkv_proj": ((heads + 2 * kv) * head_dim, hidden),
            "o_proj": (hidden, heads * head_dim),
            "gate_up_proj": (2 * c["intermediate_size"], hidden),
            "down_proj": (hidden, c["intermediate_size"])}


def graph_ms(fn: Callable[[], object], calls: int) -> float:
    """Median ms per call of `fn` (which makes `calls` calls), replayed as one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    return statistics.median(cuda_time_ms(graph.replay, 10)) / calls


def case(name: str, out_f: int, in_f: int, rows: int, roof: dict[str, float],
         grid_launches: list[SkinnyLaunch]) -> dict[str, Any]:
    nbytes = out_f * in_f * 2
    copies = max(2, -(-(512 << 20) // nbytes))
    weights = [torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) / in_f ** 0.5
               for _ in range(copies)]
    x = torch.randn(rows, in_f, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), weights[0].float())
    floor_ms = nbytes / (roof["copy_TBps"] * 1e12) * 1e3

    def over_all(op: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for w in weights:
                op(w)
        return run

    row: dict[str, Any] = {"case": f"{name} M={rows}", "floor_ms": floor_ms}
    row["cublas_ms"] = graph_ms(over_all(lambda w: F.linear(x, w)), copies)
    saved = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        row["cublaslt_ms"] = graph_ms(over_all(lambda w: F.linear(x, w)), copies)
    finally:
        torch.backends.cuda.preferred_blas_library(saved)
    try:
        row["default_ms"] = graph_ms(over_all(lambda w: skinny_linear_triton(x, w)), copies)
    except OutOfResources:  # the default launch's tiles do not fit at this many rows
        row["default_ms"] = float("nan")
    row["default"] = vars(skinny_launch(out_f, in_f, fp8=False))
    ref_err = (F.linear(x, weights[0]).float() - want).abs().max().item()
    row["grid"] = grid = []
    for launch in grid_launches:
        try:
            got = skinny_linear_triton(x, weights[0], launch=launch)
        except OutOfResources:  # too many stages of too large a tile for shared memory
            continue
        err = (got.float() - want).abs().max().item()
        assert err <= 2 * ref_err + 1e-2, f"{name} {launch}: {err} (cuBLAS {ref_err})"
        ms = graph_ms(over_all(lambda w, lc=launch: skinny_linear_triton(x, w, launch=lc)),
                      copies)
        grid.append({**vars(launch), "ms": ms})
    best = min(grid, key=lambda g: g["ms"])
    row["triton_best_ms"], row["triton_best"] = best["ms"], best
    if name == "gate_up_proj":  # the SiLU-and-mul: its own kernel, or in the epilogue
        row["cublas_silu_ms"] = graph_ms(over_all(lambda w: silu_and_mul(F.linear(x, w))),
                                         copies)
        try:
            row["fused_silu_ms"] = graph_ms(
                over_all(lambda w: skinny_linear_triton(x, w, silu=True)), copies)
        except OutOfResources:
            row["fused_silu_ms"] = float("nan")
        fused = []
        for launch in grid_launches:
            if launch.split_k > 2:
                continue
            try:
                skinny_linear_triton(x, weights[0], silu=True, launch=launch)
            except OutOfResources:
                continue
            ms = graph_ms(over_all(
                lambda w, lc=launch: skinny_linear_triton(x, w, silu=True, launch=lc)), copies)
            fused.append({**vars(launch), "ms": ms})
        row["fused_grid"] = fused
        row["fused_silu_best_ms"] = min(g["ms"] for g in fused)
    for key in ("cublas", "cublaslt", "default", "triton_best"):
        row[f"{key}_of_floor"] = floor_ms / row[f"{key}_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--out", type=Path, default=Path("skinny_gemm.json"))
    ap.add_argument("--wide", action="store_true",
                    help="search the wider grid of launches (WIDE_GRID) instead of GRID")
    ap.add_argument("--only", default="", help="comma-separated projections (default: all)")
    args = ap.parse_args()
    roof = roofline()
    print(f"roofline: {roof}", flush=True)
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        for name, (out_f, in_f) in projections(args.shape).items():
            if args.only and name not in args.only.split(","):
                continue
            rows.append(case(name, out_f, in_f, m, roof, WIDE_GRID if args.wide else GRID))
            print({k: v for k, v in rows[-1].items() if k not in ("grid", "fused_grid")},
                  flush=True)
    write_json(args.out, {"shape": args.shape, "roofline": roof,
                          "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "revision": git_revision(), "wide": args.wide}, rows)
    print_table([{k: v for k, v in r.items()
                  if k not in ("triton_best", "default", "grid", "fused_grid")} for r in rows])


if __name__ == "__main__":
    main()
