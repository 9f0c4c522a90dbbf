# ruff: noqa: B023
"""Probe, run as it was from the repository root on the GPU machine: variants of the decode
attention kernel (text edits of `kernels/paged_attention_triton.py`, loaded as modules of
their own), timed alone in CUDA graphs as `benchmarks.attention_kernel` does, with and
without rope + the KV write in the launch, at contexts that end on and inside a key tile.
Some variants are diagnostic only (they skip work and are wrong on purpose).

    python benchmarks/results/2026-12-04-h200-b256/attn_variants_probe.py
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import torch

from benchmarks.attention_kernel import HKV, D, _case, floor_ms, graph_ms
from benchmarks.runtime_vs_hf import roofline

SRC = pathlib.Path("kernels/paged_attention_triton.py").read_text()
TWO_LOOPS = """        for i in range(tile_lo, full_hi):
            m_i, l_i, acc = _attend_block(
                i, q, q_pos, kv_lo, kv_hi, m_i, l_i, acc, K, V, table, kv_head, qk_scale,
                stride_kn, stride_kb, stride_kh, offs_d, d_ok, KV_BLOCK, BLOCK_N, IEEE,
                EVEN_D, False, FP8_KV)
        for i in range(full_hi, tile_hi):"""
ONE_LOOP = """        for i in range(tile_lo, tile_hi):"""
QROPE = ("        q = _rope_rows(q, q_partner, cos[None, :], sin[None, :], upper[None, :], "
         "rope_dtype)")
BARRIER = ("        tl.debug_barrier()  # every thread's part of the write before any thread "
           "reads keys")
WRITE_IF = "        if ((n_tiles - 1) // per_split == split) & (slot >= 0):"
VARIANTS = {
    "base": [],
    "one_masked_loop": [(TWO_LOOPS, ONE_LOOP)],
    "diag_no_q_rope": [(QROPE, "        pass")],
    "diag_no_barrier": [(BARRIER, "        pass")],
    "diag_no_write": [(WRITE_IF, "        if slot < -1000000:"), (BARRIER, "        pass")],
}


def load(name: str, edits: list[tuple[str, str]]):
    src = SRC
    for old, new in edits:
        assert old in src, (name, old[:60])
        src = src.replace(old, new)
    path = pathlib.Path(f"/tmp/pa_variants/pa_{name}.py")
    path.parent.mkdir(exist_ok=True)
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"pa_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CASES = [(256, 511), (256, 515), (256, 543), (64, 519), (1, 519)]


def main() -> None:
    roof = roofline()
    mods = {name: load(name, edits) for name, edits in VARIANTS.items()}
    rows = []
    for seqs, cached in CASES:
        torch.manual_seed(0)
        q, k, v, meta = _case(seqs, cached, 1, torch.device("cuda"))
        kn = torch.randn(seqs, HKV, D, device="cuda", dtype=torch.bfloat16)
        vn = torch.randn_like(kn)
        cos, sin = torch.rand(seqs, D, device="cuda"), torch.rand(seqs, D, device="cuda")
        slots = torch.tensor([int(meta.block_tables[i, cached // 16]) * 16 + cached % 16
                              for i in range(seqs)], device="cuda")
        rec = {"seqs": seqs, "keys": cached + 1,
               "floor_us": floor_ms(seqs, cached, 1, roof) * 1e3}
        ref = mods["base"].paged_attention_triton(q, k.clone(), v.clone(), meta, D ** -0.5)
        for name, mod in mods.items():
            new = mod.NewKV(kn, vn, cos, sin, slots)
            got = mod.paged_attention_triton(q, k.clone(), v.clone(), meta, D ** -0.5)
            rec[f"{name}_plain_maxdiff"] = (got.float() - ref.float()).abs().max().item()
            rec[f"{name}_plain_us"] = graph_ms(lambda: mod.paged_attention_triton(
                q, k, v, meta, D ** -0.5), 20) * 1e3
            rec[f"{name}_fused_us"] = graph_ms(lambda: mod.paged_attention_triton(
                q, k, v, meta, D ** -0.5, new=new), 20) * 1e3
        print(json.dumps({a: (round(b, 2) if isinstance(b, float) else b)
                          for a, b in rec.items()}), flush=True)
        rows.append(rec)
    with open(os.path.join(os.environ.get("OUT", "."), "attn_variants.json"), "w") as f:
        json.dump({"roofline": roof, "rows": rows}, f, indent=1)
    print(f"{'case':14}" + "".join(f"{n[:15]:>16}" for n in VARIANTS))
    for r in rows:
        for kind in ("plain", "fused"):
            print(f"b{r['seqs']} k{r['keys']} {kind[:2]:3}"
                  + "".join(f"{r[f'{n}_{kind}_us']:16.2f}" for n in VARIANTS))


if __name__ == "__main__":
    main()
