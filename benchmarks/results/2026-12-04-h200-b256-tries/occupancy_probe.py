"""Probe, run from the repository root on the GPU machine (`PYTHONPATH=$PWD`): the decode
attention kernel's registers and shared memory per program at each decode launch, and so
how many programs an SM holds at once, for llama3-8b heads at 256 sequences (bf16), alone
and with rope + the KV write in the launch.

    python benchmarks/results/2026-12-04-h200-b256-tries/occupancy_probe.py
"""
from __future__ import annotations

import json
import os

import torch

import kernels.paged_attention_triton as pat
from benchmarks.attention_kernel import DECODE_GRID, HKV, D, _case


def compiled() -> list[object]:
    found = []
    for caches in pat._paged_attention_kernel.device_caches.values():
        for part in caches if isinstance(caches, tuple) else (caches,):
            if isinstance(part, dict):
                found += [k for k in part.values() if hasattr(k, "n_regs")]
    return found


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    q, k, v, meta = _case(256, 519, 1, torch.device("cuda"))
    for launch in DECODE_GRID:
        pat.paged_attention_triton(q, k, v, meta, D ** -0.5, splits=1, launch=launch)
    kn = torch.randn(256, HKV, D, device="cuda", dtype=torch.bfloat16)
    new = pat.NewKV(kn, torch.randn_like(kn), torch.rand(256, D, device="cuda"),
                    torch.rand(256, D, device="cuda"),
                    torch.arange(256, device="cuda") * 16 * 33 + 7)
    pat.paged_attention_triton(q, k, v, meta, D ** -0.5, new=new)
    torch.cuda.synchronize()
    rows = []
    for kern in compiled():
        md = kern.metadata
        warps, shared, n_regs = md.num_warps, md.shared, kern.n_regs
        by_smem = smem // max(shared, 1)
        by_regs = regs // max(n_regs * 32 * warps, 1)
        c = getattr(getattr(kern, "src", None), "constants", None) or {}
        rows.append({"num_warps": warps, "num_stages": md.num_stages, "shared": shared,
                     "n_regs": n_regs, "programs_per_sm": min(by_smem, by_regs, 32),
                     "by_smem": by_smem, "by_regs": by_regs, "name": md.name,
                     "constants": str(c)[:300]})
        print(json.dumps({kk: vv for kk, vv in rows[-1].items() if kk != "constants"}))
    with open(os.path.join(os.environ.get("OUT", "."), "occupancy.json"), "w") as f:
        json.dump({"smem_per_sm": smem, "regs_per_sm": regs, "kernels": rows}, f, indent=1)


if __name__ == "__main__":
    main()
