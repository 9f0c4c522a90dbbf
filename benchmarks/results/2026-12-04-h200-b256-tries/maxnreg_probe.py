# ruff: noqa: B023
"""Probe, run from the repository root on the GPU machine (`PYTHONPATH=$PWD`): the decode
attention kernel alone (llama3-8b heads, bf16, CUDA graphs, `benchmarks.attention_kernel`'s
method) with its registers capped by Triton's `maxnreg` launch option (more programs per
SM, at the risk of spills), alone and with rope + the KV write, two rounds alternating.

    python benchmarks/results/2026-12-04-h200-b256-tries/maxnreg_probe.py
"""
from __future__ import annotations

import functools
import json
import os

import torch

import kernels.paged_attention_triton as pat
from benchmarks.attention_kernel import HKV, D, _case, graph_ms

CASES = [(256, 519), (256, 511), (128, 519), (64, 519), (1, 511)]
CAPS = (None, 192, 168, 128)


def main() -> None:
    kernel = pat._paged_attention_kernel
    plain_run = kernel.run
    rows = []
    for seqs, cached in CASES:
        torch.manual_seed(0)
        q, k, v, meta = _case(seqs, cached, 1, torch.device("cuda"))
        kn = torch.randn(seqs, HKV, D, device="cuda", dtype=torch.bfloat16)
        cos, sin = torch.rand(seqs, D, device="cuda"), torch.rand(seqs, D, device="cuda")
        slots = torch.tensor([int(meta.block_tables[i, cached // 16]) * 16 + cached % 16
                              for i in range(seqs)], device="cuda")
        new = pat.NewKV(kn, torch.randn_like(kn), cos, sin, slots)
        rec: dict[str, object] = {"seqs": seqs, "keys": cached + 1}
        want = pat.paged_attention_triton(q, k, v, meta, D ** -0.5)
        for _ in range(2):
            for cap in CAPS:
                kernel.run = (plain_run if cap is None
                              else functools.partial(plain_run, maxnreg=cap))
                out = pat.paged_attention_triton(q, k, v, meta, D ** -0.5)
                rec[f"max_abs_diff_{cap}"] = (out.float() - want.float()).abs().max().item()
                for tag, kw in (("alone", {}), ("fused", {"new": new})):
                    us = graph_ms(lambda: pat.paged_attention_triton(
                        q, k, v, meta, D ** -0.5, **kw), 20) * 1e3
                    rec.setdefault(f"{tag}_{cap}", []).append(round(us, 2))
        kernel.run = plain_run
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    with open(os.path.join(os.environ.get("OUT", "."), "maxnreg.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
