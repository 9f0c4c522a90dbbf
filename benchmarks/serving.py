"""W5 at small scale: online serving latency through the HTTP gateway beside direct gRPC.

One mesh (`stagemesh serve` with its gateway, prefix caching off) serves one Poisson arrival
schedule at `--rate` in which requests alternate between the two paths (ABBA order): direct
gRPC (`RouterClient`) and streamed /v1/completions through the gateway. Interleaving puts both
paths under the same load at the same moments, so the ratio holds on a shared, noisy machine.
Each path gets `--requests` requests; prompts are random token ids, outputs have a fixed
length (EOS ignored). Metrics as vLLM's
`bench serve`: TTFT from send to the first streamed token; TPOT per request = (end - first
token) / (output tokens - 1); ITL = gaps between streamed chunks; percentiles by linear
interpolation; warm-up requests excluded. The ratio row is gateway / gRPC.

    python -m benchmarks.serving --requests 40 --rate 1
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np

from benchmarks.report import git_revision, print_table, write_json
from router.client import RouterClient
from stagemesh.local_mesh import Mesh, free_port

FIRST_ORDINARY_ID = 100  # below: special and byte tokens of the default model


@dataclass
class Result:
    """One request as the client saw it: send time, arrival time of each streamed chunk that
    carried tokens, and the number of output tokens."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


async def grpc_request(client: RouterClient, prompt: list[int], out_len: int) -> Result:
    r = Result(time.perf_counter())
    try:
        async for chunk in client.generate(token_ids=prompt, max_tokens=out_len,
                                           ignore_eos=True, temperature=0.0):
            if chunk.token_ids:
                r.chunks.append(time.perf_counter())
                r.tokens += len(chunk.token_ids)
    except Exception as e:  # a failed request is counted, not fatal
        r.error = repr(e)
    return r


async def http_request(http: httpx.AsyncClient, model: str, prompt: list[int],
                       out_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    r = Result(time.perf_counter())
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if event.get("usage"):
                    r.tokens = event["usage"]["completion_tokens"]
                elif event.get("choices") and event["choices"][0]["text"]:
                    r.chunks.append(time.perf_counter())
    except Exception as e:
        r.error = repr(e)
    return r


async def run_schedule(sends: list[Any], prompts: list[list[int]], gaps: list[float],
                       out_len: int) -> tuple[list[Result], float]:
    """Request i (prompt i, sent by sends[i]) at its Poisson arrival time; (results, wall
    time from the first arrival to the last response)."""
    start = time.perf_counter()
    tasks = []
    for send, prompt, gap in zip(sends, prompts, gaps, strict=True):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(send(prompt, out_len)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start


def summarize(path: str, results: list[Result], duration: float, out_len: int
              ) -> dict[str, Any]:
    ok = [r for r in results if r.error is None and r.chunks]
    ttft = [(r.chunks[0] - r.sent) * 1e3 for r in ok]
    tpot = [(r.chunks[-1] - r.chunks[0]) * 1e3 / (r.tokens - 1) for r in ok if r.tokens > 1]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r.chunks, r.chunks[1:], strict=False)]
    row: dict[str, Any] = {"path": path, "ok": len(ok), "failed": len(results) - len(ok),
                           "req_s": len(ok) / duration,
                           "out_tok_s": sum(r.tokens for r in ok) / duration}
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        arr = np.asarray(values or [float("nan")])
        row[f"{name}_mean"] = float(arr.mean())
        row[f"{name}_p50"] = float(np.percentile(arr, 50))
        row[f"{name}_p99"] = float(np.percentile(arr, 99))
    row["tokens_ok"] = all(r.tokens == out_len for r in ok)
    return row


async def measure(mesh: Mesh, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = np.random.default_rng(args.seed)
    total = 2 * args.requests
    assert mesh.gateway_url is not None
    async with RouterClient(mesh.address) as client, \
            httpx.AsyncClient(base_url=mesh.gateway_url, timeout=600) as http:
        info = await client.model_info()
        prompts = [rng.integers(FIRST_ORDINARY_ID, info.vocab_size, args.prompt_len).tolist()
                   for _ in range(total + args.warmup)]
        gaps = rng.exponential(1.0 / args.rate, total).tolist()

        async def via_grpc(prompt: list[int], out_len: int) -> Result:
            return await grpc_request(client, prompt, out_len)

        async def via_http(prompt: list[int], out_len: int) -> Result:
            return await http_request(http, info.model, prompt, out_len)

        for prompt in prompts[:args.warmup]:  # connections, the gateway's model info, caches
            await via_grpc(prompt, args.output_len)
            await via_http(prompt, args.output_len)
        grpc_first = [i % 4 in (0, 3) for i in range(total)]  # A B B A A B B A ...
        sends = [via_grpc if g else via_http for g in grpc_first]
        results, duration = await run_schedule(sends, prompts[args.warmup:], gaps,
                                               args.output_len)
    return [summarize(path, [r for r, g in zip(results, grpc_first, strict=True)
                             if g == want], duration, args.output_len)
            for path, want in (("grpc", True), ("gateway", False))]


def ratio_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    grpc_row, http_row = rows
    out: dict[str, Any] = {"path": "gateway/grpc"}
    for key, value in grpc_row.items():
        if key != "path" and isinstance(value, float) and value:
            out[key] = http_row[key] / value
        elif key != "path":
            out[key] = ""
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40, help="per path")
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, req/s")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/w5-cpu-{dt.date.today()}.json"))
    args = ap.parse_args()
    config: dict[str, Any] = {
        "workload": "W5 (small scale)", "model": "smollm2-135m (default model, real weights)",
        "device": "cpu", "dtype": "float32", "stages": args.stages, "tp": 1,
        "transport": "tcp", "prefix_caching": False, "requests": args.requests,
        "rate_req_s": args.rate, "order": "interleaved ABBA", "prompt_len": args.prompt_len,
        "output_len": args.output_len, "warmup": args.warmup, "seed": args.seed,
        "http_client": "httpx2 (raw SSE)", "grpc_client": "router.client.RouterClient",
        "revision": git_revision()}
    print(config, flush=True)
    with Mesh("--stages", str(args.stages), "--num-blocks", "1024", "--no-prefix-caching",
              gateway_port=free_port()) as mesh:
        rows = asyncio.run(measure(mesh, args))
    rows.append(ratio_row(rows))
    write_json(args.out, config, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
