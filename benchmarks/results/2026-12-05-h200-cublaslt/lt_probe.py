# ruff: noqa
"""Probe: every algorithm cuBLASLt's heuristic offers (through ctypes) for llama3-8b's
projections and LM head at 256 and 64 rows, each timed in a CUDA graph over >= 512 MB of
weight copies (cold L2), against torch's F.linear through cuBLAS and through cuBLASLt.

    PYTHONPATH=. python benchmarks/results/2026-12-05-h200-cublaslt/lt_probe.py 256,64
"""
from __future__ import annotations

import ctypes
import json
import os
import sys

import torch
import torch.nn.functional as F

from benchmarks.runtime_vs_hf import roofline
from benchmarks.skinny_gemm import graph_ms, projections


def _lib() -> ctypes.CDLL:
    torch.mm(torch.ones(64, 64, device="cuda", dtype=torch.bfloat16),
             torch.ones(64, 64, device="cuda", dtype=torch.bfloat16))
    torch.backends.cuda.preferred_blas_library("cublaslt")
    F.linear(torch.ones(8, 64, device="cuda", dtype=torch.bfloat16),
             torch.ones(64, 64, device="cuda", dtype=torch.bfloat16))
    torch.backends.cuda.preferred_blas_library("cublas")
    torch.cuda.synchronize()
    for line in open("/proc/self/maps"):
        if "libcublasLt" in line:
            return ctypes.CDLL(line.split()[-1])
    raise SystemExit("no libcublasLt loaded")


LT = _lib()
vp = ctypes.c_void_p


def ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: cublas status {status}")


class Heur(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("ws", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


HANDLE = vp()
ok(LT.cublasLtCreate(ctypes.byref(HANDLE)), "create")
WS_BYTES = 64 << 20
WS = torch.empty(WS_BYTES, dtype=torch.uint8, device="cuda")


class Plan:
    """Y[M, N] = X[M, K] @ W[N, K]^T in column-major terms: D[N, M] = W^T(op T)[N, K] . X^T[K, M]."""

    def __init__(self, m: int, n: int, k: int) -> None:
        self.desc = vp()
        ok(LT.cublasLtMatmulDescCreate(ctypes.byref(self.desc), 68, 0), "desc")
        t, nn = ctypes.c_int32(1), ctypes.c_int32(0)
        ok(LT.cublasLtMatmulDescSetAttribute(self.desc, 3, ctypes.byref(t), ctypes.c_size_t(4)), "transa")
        ok(LT.cublasLtMatmulDescSetAttribute(self.desc, 4, ctypes.byref(nn), ctypes.c_size_t(4)), "transb")
        self.a, self.b, self.c = vp(), vp(), vp()
        ok(LT.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), 14, ctypes.c_uint64(k),
                                         ctypes.c_uint64(n), ctypes.c_int64(k)), "a")
        ok(LT.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), 14, ctypes.c_uint64(k),
                                         ctypes.c_uint64(m), ctypes.c_int64(k)), "b")
        ok(LT.cublasLtMatrixLayoutCreate(ctypes.byref(self.c), 14, ctypes.c_uint64(n),
                                         ctypes.c_uint64(m), ctypes.c_int64(n)), "c")
        pref = vp()
        ok(LT.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        wsb = ctypes.c_uint64(WS_BYTES)
        ok(LT.cublasLtMatmulPreferenceSetAttribute(pref, 1, ctypes.byref(wsb), ctypes.c_size_t(8)), "pref ws")
        self.results = (Heur * 64)()
        count = ctypes.c_int(0)
        ok(LT.cublasLtMatmulAlgoGetHeuristic(HANDLE, self.desc, self.a, self.b, self.c, self.c,
                                             pref, 64, self.results, ctypes.byref(count)),
           "heuristic")
        self.count = count.value
        self.alpha = ctypes.c_float(1.0)
        self.beta = ctypes.c_float(0.0)

    def config(self, i: int) -> dict[str, int]:
        out = {}
        for name, attr, size in (("id", 0, 4), ("tile", 1, 4), ("splitk", 2, 4),
                                 ("reduction", 3, 4), ("swizzle", 4, 4), ("custom", 5, 4),
                                 ("stages", 6, 4), ("inner", 7, 2), ("cluster", 8, 2)):
            buf = ctypes.c_uint64(0)
            written = ctypes.c_size_t(0)
            st = LT.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(self.results[i].algo), attr,
                                                         ctypes.byref(buf), ctypes.c_size_t(size),
                                                         ctypes.byref(written))
            out[name] = int(buf.value) if st == 0 else -1
        out["ws"] = int(self.results[i].ws)
        out["waves"] = round(float(self.results[i].waves), 3)
        return out

    def run(self, i: int, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        ok(LT.cublasLtMatmul(HANDLE, self.desc, ctypes.byref(self.alpha), vp(w.data_ptr()), self.a,
                             vp(x.data_ptr()), self.b, ctypes.byref(self.beta),
                             vp(y.data_ptr()), self.c, vp(y.data_ptr()), self.c,
                             ctypes.byref(self.results[i].algo), vp(WS.data_ptr()),
                             ctypes.c_size_t(self.results[i].ws), vp(stream)), "matmul")


def main() -> None:
    rows = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [256]
    roof = roofline()
    print("roofline", roof, flush=True)
    shapes = dict(projections("llama3-8b"))
    shapes["lm_head"] = (128256, 4096)
    out = []
    for m in rows:
        for name, (n, k) in shapes.items():
            nbytes = n * k * 2
            copies = max(2, -(-(512 << 20) // nbytes))
            ws_ = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
                   for _ in range(copies)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, ws_[0]).float()
            floor = max(nbytes / (roof["copy_TBps"] * 1e12),
                        2 * m * n * k / (roof["bf16_TFLOPs"] * 1e12)) * 1e3
            rec = {"case": f"{name} M={m}", "floor_ms": floor}
            rec["cublas_ms"] = graph_ms(lambda: [F.linear(x, w) for w in ws_], copies)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            rec["cublaslt_ms"] = graph_ms(lambda: [F.linear(x, w) for w in ws_], copies)
            torch.backends.cuda.preferred_blas_library("cublas")
            plan = Plan(m, n, k)
            algos = []
            for i in range(plan.count):
                cfg = plan.config(i)
                try:
                    plan.run(i, x, ws_[0], y)
                    torch.cuda.synchronize()
                    err = (y.float() - want).abs().max().item()
                    ms = graph_ms(lambda i=i: [plan.run(i, x, w, y) for w in ws_], copies)
                except Exception as e:  # noqa: BLE001
                    print("algo", i, "failed", e, flush=True)
                    continue
                algos.append({"rank": i, "ms": ms, "err": err, **cfg})
            algos.sort(key=lambda a: a["ms"])
            rec["heuristic_count"] = plan.count
            rec["lt_first_ms"] = next((a["ms"] for a in algos if a["rank"] == 0), None)
            rec["algos"] = algos
            print(json.dumps({k: v for k, v in rec.items() if k != "algos"}),
                  json.dumps(algos[:3]), flush=True)
            out.append(rec)
            del ws_
            torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "lt_algos.json"), "w") as f:
        json.dump({"roofline": roof, "rows": out}, f, indent=1)
    print(f"{'case':20} {'floor':>7} {'cublas':>7} {'lt':>7} {'lt#0':>7} {'best':>7} best cfg")
    for r in out:
        b = r["algos"][0] if r["algos"] else {}
        print(f"{r['case']:20} {r['floor_ms']*1e3:7.1f} {r['cublas_ms']*1e3:7.1f} "
              f"{r['cublaslt_ms']*1e3:7.1f} {(r['lt_first_ms'] or 0)*1e3:7.1f} "
              f"{b.get('ms', 0)*1e3:7.1f} {b}")


if __name__ == "__main__":
    main()
