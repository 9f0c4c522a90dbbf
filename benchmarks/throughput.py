"""Offline throughput through the mesh (W1 / W3 / W4 shape): N requests of random prompt
token ids, all submitted at t=0 over gRPC, EOS ignored; output tok/s per pipeline depth.

    python -m benchmarks.throughput --model DIR --stages 1,2 --requests 256 \\
        --prompt-len 512 --output-len 256 --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import random
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.report import git_revision, print_table, write_json
from router.client import RouterClient
from stagemesh.local_mesh import Mesh


async def run(address: str, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Submit every prompt at once; output tok/s over the wall time, and per request the time
    to its first token and the mean time per output token after it (TPOT), as the client
    sees them (W2's per-token time is TPOT at one request)."""
    async with RouterClient(address) as client:
        await client.complete(token_ids=prompts[0][:8], max_tokens=4, ignore_eos=True)  # warm

        async def one(prompt: list[int]) -> tuple[int, float, float]:
            n, first, last = 0, 0.0, 0.0
            async for chunk in client.generate(token_ids=prompt, max_tokens=output_len,
                                               ignore_eos=True, temperature=0.0, timeout=3600):
                if chunk.token_ids:
                    last = time.perf_counter()
                    first = first or last
                    n += len(chunk.token_ids)
            return n, first - t0, (last - first) / max(1, n - 1)

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    out_tokens = sum(n for n, _, _ in outs)
    in_tokens = sum(len(p) for p in prompts)
    ttft = [t for _, t, _ in outs]
    tpot = [t for n, _, t in outs if n > 1]
    return {"wall_s": wall, "output_tok_s": out_tokens / wall,
            "total_tok_s": (out_tokens + in_tokens) / wall, "output_tokens": out_tokens,
            "ttft_ms_mean": 1e3 * statistics.fmean(ttft),
            "ttft_ms_p50": 1e3 * statistics.median(ttft),
            "tpot_ms_mean": 1e3 * statistics.fmean(tpot) if tpot else 0.0,
            "tpot_ms_p50": 1e3 * statistics.median(tpot) if tpot else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--extra", default="", help="more `stagemesh serve` flags")
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/throughput-{dt.date.today()}.json"))
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]
    config: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "out"}
    config |= {"transport": "tcp", "tp": 1, "revision": git_revision()}
    print(config, flush=True)
    rows = []
    for p in (int(x) for x in args.stages.split(",")):
        flags = ["--model", args.model, "--stages", str(p), "--device", args.device,
                 "--max-num-seqs", str(args.max_num_seqs),
                 "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                 *args.extra.split()]
        with Mesh(*flags, timeout=900) as mesh:
            rows.append({"stages": p, **asyncio.run(run(mesh.address, prompts,
                                                          args.output_len))})
        print(rows[-1], flush=True)
    for r in rows:
        r["vs_1_stage"] = r["output_tok_s"] / rows[0]["output_tok_s"]
    write_json(args.out, config, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
