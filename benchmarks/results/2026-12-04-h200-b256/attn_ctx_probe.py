# ruff: noqa: B023
"""Probe, run as it was from the repository root on the GPU machine: the decode attention
kernel alone (llama3-8b heads, bf16, in CUDA graphs, `benchmarks.attention_kernel`'s method)
at contexts that end inside a key tile (a served step's 513-522 keys take 9 tiles of 64
where 512 take 8), over the decode launch grid and split counts, and with rope and the KV
write in the launch as a served step runs it.

    python benchmarks/results/2026-12-04-h200-b256/attn_ctx_probe.py
"""
from __future__ import annotations

import json
import os

import torch

from benchmarks.attention_kernel import DECODE_GRID, HKV, HQ, D, _case, floor_ms, graph_ms
from benchmarks.runtime_vs_hf import roofline
from kernels.attention_launch import DECODE_LAUNCH, SPLIT_DECODE_LAUNCH
from kernels.paged_attention_triton import NewKV, paged_attention_triton

CASES = [(256, 511), (256, 515), (256, 519), (256, 543), (64, 519), (128, 519)]


def main() -> None:
    roof = roofline()
    out = []
    for seqs, cached in CASES:
        torch.manual_seed(0)
        q, k, v, meta = _case(seqs, cached, 1, torch.device("cuda"))
        floor = floor_ms(seqs, cached, 1, roof) * 1e3
        rec: dict[str, object] = {"seqs": seqs, "keys": cached + 1, "floor_us": floor}
        timed = []
        for splits in (1, 2, 4):
            for launch in DECODE_GRID:
                if splits > 1 and launch.num_stages > 2:
                    continue
                try:
                    us = graph_ms(lambda lc=launch, s=splits: paged_attention_triton(
                        q, k, v, meta, D ** -0.5, splits=s, launch=lc), 20) * 1e3
                except Exception:
                    continue
                timed.append((us, splits, vars(launch)))
        timed.sort(key=lambda t: t[0])
        rec["default_us"] = next(t[0] for t in timed if t[1] == 1 and t[2] == vars(DECODE_LAUNCH))
        split2 = [t for t in timed if t[1] == 2 and t[2] == vars(SPLIT_DECODE_LAUNCH)]
        rec["split2_default_us"] = split2[0][0] if split2 else None
        rec["top5"] = timed[:5]
        # rope + KV write in the launch (the served path), default launch
        kn = torch.randn(seqs, HKV, D, device="cuda", dtype=torch.bfloat16)
        vn = torch.randn_like(kn)
        cos = torch.rand(seqs, D, device="cuda")
        sin = torch.rand(seqs, D, device="cuda")
        slots = torch.tensor([int(meta.block_tables[i, cached // 16]) * 16 + cached % 16
                              for i in range(seqs)], device="cuda")
        new = NewKV(kn, vn, cos, sin, slots)
        rec["fused_default_us"] = graph_ms(lambda: paged_attention_triton(
            q, k, v, meta, D ** -0.5, new=new), 20) * 1e3
        print(json.dumps({kk: vv for kk, vv in rec.items() if kk != "top5"}),
              rec["top5"][:3], flush=True)
        out.append(rec)
    with open(os.path.join(os.environ.get("OUT", "."), "attn_ctx.json"), "w") as f:
        json.dump({"roofline": roof, "heads": [HQ, HKV, D], "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
