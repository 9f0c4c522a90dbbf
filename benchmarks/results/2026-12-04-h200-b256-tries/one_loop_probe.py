# ruff: noqa: B023
"""Probe (needs one_loop_tried.patch applied: it adds the kernel's ONE_LOOP switch), run
from the repository root on the GPU machine: the decode attention kernel alone
(llama3-8b heads, bf16, CUDA graphs, `benchmarks.attention_kernel`'s method) with a
sequence's last partial key tile as one more iteration of the pipelined loop
(`ONE_LOOP`, clamped block reads, masked scores) against the separate masked tail loop,
alternating, at the launch the kernel picks, alone and with rope + the KV write in the launch.

    python benchmarks/results/2026-12-04-h200-b256-tries/one_loop_probe.py
"""
from __future__ import annotations

import json
import os

import torch

import kernels.paged_attention_triton as pat
from benchmarks.attention_kernel import HKV, D, _case, graph_ms
from benchmarks.runtime_vs_hf import roofline
from kernels.paged_attention_triton import NewKV, paged_attention_triton

CASES = [(256, 511), (256, 515), (256, 519), (256, 543), (256, 575), (128, 519), (64, 519),
         (16, 519), (1, 511), (1, 4095)]


def main() -> None:
    roof = roofline()
    rows = []
    for seqs, cached in CASES:
        torch.manual_seed(0)
        q, k, v, meta = _case(seqs, cached, 1, torch.device("cuda"))
        kn = torch.randn(seqs, HKV, D, device="cuda", dtype=torch.bfloat16)
        vn = torch.randn_like(kn)
        cos, sin = torch.rand(seqs, D, device="cuda"), torch.rand(seqs, D, device="cuda")
        slots = torch.tensor([int(meta.block_tables[i, cached // 16]) * 16 + cached % 16
                              for i in range(seqs)], device="cuda")
        new = NewKV(kn, vn, cos, sin, slots)
        floor = seqs * (cached + 1) * HKV * D * 4 / (roof["copy_TBps"] * 1e12) * 1e6
        rec = {"seqs": seqs, "keys": cached + 1, "floor_us": floor}
        outs = {}
        for _ in range(2):
            for one in (False, True):
                pat.ONE_LOOP = one
                tag = "one_loop" if one else "tail_loop"
                outs[tag] = paged_attention_triton(q, k, v, meta, D ** -0.5)
                rec.setdefault(tag + "_us", []).append(graph_ms(
                    lambda: paged_attention_triton(q, k, v, meta, D ** -0.5), 20) * 1e3)
                rec.setdefault(tag + "_fused_us", []).append(graph_ms(
                    lambda: paged_attention_triton(q, k, v, meta, D ** -0.5, new=new), 20) * 1e3)
        diff = outs["one_loop"].float() - outs["tail_loop"].float()
        rec["max_abs_diff"] = diff.abs().max().item()
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    with open(os.path.join(os.environ.get("OUT", "."), "one_loop.json"), "w") as f:
        json.dump({"roofline": roof, "rows": rows}, f, indent=1)
    print("\nseqs keys floor | tail alone | one alone | tail fused | one fused  (us, 2 rounds)")
    for r in rows:
        print(r["seqs"], r["keys"], round(r["floor_us"], 1), "|",
              *(" / ".join(f"{x:.2f}" for x in r[t]) + " |" for t in
                ("tail_loop_us", "one_loop_us", "tail_loop_fused_us", "one_loop_fused_us")),
              f"diff {r['max_abs_diff']:.3g}")


if __name__ == "__main__":
    main()
