# ruff: noqa: B023
"""Probe, run as it was from the repository root on the GPU machine: where the llama3-8b
decode step at batch 256 (512 context, CUDA graphs, 10 steps queued back to back) spends
its GPU time, kernel by kernel, and whether cuBLAS's batched GEMM over a split K fills the
card better than F.linear for the projections with few output tiles.

    python benchmarks/results/2026-12-04-h200-b256/b256_probe.py [--step-only] [OUT.json]
"""
from __future__ import annotations

import json
import os
import re
import statistics
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F

from benchmarks.runtime_vs_hf import build_models, cuda_time_ms, roofline
from benchmarks.skinny_gemm import graph_ms, projections
from stage_worker.step_input import SeqChunk

OUT = os.environ.get("OUT", ".")
BATCH, CTX, BURST = 256, 512, 10
KINDS = [("gemm", re.compile(r"gemm|nvjet|sm90_xmma|cutlass", re.I)),
         ("attention", re.compile(r"paged_attention|merge_splits")),
         ("rope_kv", re.compile(r"rope_kv")),
         ("norm", re.compile(r"rms_norm")),
         ("silu", re.compile(r"silu")),
         ("embedding", re.compile(r"index|embedding|gather", re.I))]


def kind(name: str) -> str:
    for k, pat in KINDS:
        if pat.search(name):
            return k
    return "other"


@torch.inference_mode()
def step_profile() -> dict[str, object]:
    hf, runner, cfg = build_models("llama3-8b", num_blocks=BATCH * 36 + 64)
    del hf
    torch.cuda.empty_cache()
    blocks = 36
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(BATCH)]
    ids = torch.randint(0, cfg.vocab_size, (BATCH, CTX))
    for start in range(0, BATCH, 8):
        group = range(start, start + 8)
        runner.execute([SeqChunk(i, 0, CTX, tables[i]) for i in group],
                       ids[list(group)].reshape(-1))
    nxt = torch.randint(0, cfg.vocab_size, (BATCH,))

    def burst() -> None:
        for k in range(BURST):
            runner.execute([SeqChunk(i, CTX + k, 1, tables[i]) for i in range(BATCH)], nxt)

    for _ in range(2):
        burst()
    wall = statistics.median(cuda_time_ms(burst, 5)) / BURST
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        burst()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, None
    for s, e in spans:
        if end is None or s >= end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    span = spans[-1][1] - spans[0][0]
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        by_name[e.name].append(e.time_range.elapsed_us())
    names = [{"name": n[:120], "kind": kind(n), "calls_per_step": len(v) / BURST,
              "us_per_step": sum(v) / BURST, "us_per_call": sum(v) / len(v)}
             for n, v in by_name.items()]
    names.sort(key=lambda r: -r["us_per_step"])
    kinds: dict[str, float] = defaultdict(float)
    for r in names:
        kinds[r["kind"]] += r["us_per_step"]
    return {"wall_ms_per_step": wall, "profiled_span_ms_per_step": span / 1e3 / BURST,
            "busy_ms_per_step": busy / 1e3 / BURST,
            "kernels_ms_per_step": sum(r["us_per_step"] for r in names) / 1e3,
            "kinds_ms_per_step": {k: v / 1e3 for k, v in sorted(kinds.items())},
            "kernels": names[:40]}


def split_k(x: torch.Tensor, w: torch.Tensor, s: int, fp32: bool) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T as s batched GEMMs over K/s each, partials summed."""
    m, k = x.shape
    n = w.shape[0]
    a = x.view(m, s, k // s).transpose(0, 1)            # [s, M, K/s]
    b = w.view(n, s, k // s).permute(1, 2, 0)           # [s, K/s, N]
    if fp32:
        return torch.bmm(a, b, out_dtype=torch.float32).sum(0).to(x.dtype)
    return torch.bmm(a, b).sum(0)


@torch.inference_mode()
def gemm_probe(roof: dict[str, float]) -> list[dict[str, object]]:
    rows = []
    for name, (n, k) in projections("llama3-8b").items():
        nbytes = n * k * 2
        copies = max(2, -(-(512 << 20) // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
              for _ in range(copies)]
        x = torch.randn(BATCH, k, device="cuda", dtype=torch.bfloat16)
        want = F.linear(x.float(), ws[0].float())
        floor = max(nbytes / (roof["copy_TBps"] * 1e12),
                    2 * BATCH * n * k / (roof["bf16_TFLOPs"] * 1e12)) * 1e3

        def over(op):
            def run():
                for w in ws:
                    op(w)
            return run
        rec: dict[str, object] = {"case": f"{name} M={BATCH}", "floor_us": floor * 1e3,
                                  "cublas_us": graph_ms(over(lambda w: F.linear(x, w)),
                                                        copies) * 1e3}
        ref_err = (F.linear(x, ws[0]).float() - want).abs().max().item()
        rec["cublas_err"] = ref_err
        for s in (2, 4, 8):
            for fp32 in (False, True):
                label = f"split{s}{'_fp32' if fp32 else ''}"
                try:
                    got = split_k(x, ws[0], s, fp32)
                    rec[label + "_err"] = (got.float() - want).abs().max().item()
                    rec[label + "_us"] = graph_ms(
                        over(lambda w, s=s, f=fp32: split_k(x, w, s, f)), copies) * 1e3
                except Exception as e:  # out_dtype not in this torch
                    rec[label + "_us"] = repr(e)[:100]
        print(json.dumps(rec), flush=True)
        rows.append(rec)
        ws = []
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    roof = roofline()
    print("roofline", roof, flush=True)
    gemm = [] if "--step-only" in sys.argv else gemm_probe(roof)
    prof = step_profile()
    os.makedirs(OUT, exist_ok=True)
    name = next((a for a in sys.argv[1:] if a.endswith(".json")), "b256_probe.json")
    with open(os.path.join(OUT, name), "w") as f:
        json.dump({"roofline": roof, "gemm": gemm, "step": prof}, f, indent=1)
    print(json.dumps({k: v for k, v in prof.items() if k != "kernels"}, indent=1))
    for r in prof["kernels"][:25]:  # type: ignore[index]
        print(f"{r['us_per_step']:9.1f} us/step {r['calls_per_step']:6.1f} calls "
              f"{r['kind']:10} {r['name'][:90]}")
    for r in gemm:
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
