"""Offline throughput through the mesh (W1 / W3 / W4 shape): N requests of random prompt
token ids, all submitted at t=0 over gRPC, EOS ignored; output tok/s per pipeline depth.

    python -m benchmarks.throughput --model DIR --stages 1,2 --requests 256 \\
        --prompt-len 512 --output-len 256 --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import multiprocessing
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.otlp_sink import OtlpSink
from benchmarks.report import (
    git_revision,
    model_info,
    print_table,
    process_cpu,
    stage_figures,
    write_json,
)
from benchmarks.serving_metrics import stats
from router.client import RouterClient
from stagemesh.local_mesh import Mesh


async def _client(address: str, prompts: list[list[int]], output_len: int,
                  start: Callable[[], None], own_connection: bool
                  ) -> tuple[float, float, list[tuple[int, float, float, list[float]]]]:
    """One client: warm up, wait for `start()`, then submit every prompt at once. Returns
    (start time, end time, per request (tokens, TTFT, TPOT, gaps between its updates));
    times are perf_counter seconds, one clock for every process of the machine."""
    async with RouterClient(address, own_connection=own_connection) as client:
        await client.complete(token_ids=prompts[0][:8], max_tokens=4, ignore_eos=True)  # warm
        start()

        async def one(prompt: list[int]) -> tuple[int, float, float, list[float]]:
            n, first, last = 0, 0.0, 0.0
            gaps: list[float] = []
            async for chunk in client.generate(token_ids=prompt, max_tokens=output_len,
                                               ignore_eos=True, temperature=0.0, timeout=3600):
                if chunk.token_ids:
                    now = time.perf_counter()
                    if last:
                        gaps.append(now - last)
                    last = now
                    first = first or last
                    n += len(chunk.token_ids)
            return n, first - t0, (last - first) / max(1, n - 1), gaps

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        return t0, time.perf_counter(), outs


def _client_process(address: str, prompts: list[list[int]], output_len: int,
                    barrier: Any, results: Any) -> None:
    results.put(asyncio.run(_client(address, prompts, output_len, barrier.wait, True)))


def run(address: str, prompts: list[list[int]], output_len: int,
        clients: int = 1) -> dict[str, float]:
    """Submit every prompt at once from `clients` client processes (1: this process), each
    on its own connection (so the router's front processes share them); output tok/s over
    the wall time from the first submission to the last token, and per request the time
    to its first token and the mean time per output token after it (TPOT), as the clients
    see them (W2's per-token time is TPOT at one request), and the gaps between a
    request's streamed updates (ITL) over all requests: median, p99 (linear interpolation,
    `serving_metrics.stats`) and the longest."""
    if clients == 1:
        t0, t1, outs = asyncio.run(_client(address, prompts, output_len, lambda: None, False))
        spans = [(t0, t1)]
    else:
        ctx = multiprocessing.get_context("spawn")
        barrier, queue = ctx.Barrier(clients), ctx.Queue()
        procs = [ctx.Process(target=_client_process,
                             args=(address, prompts[i::clients], output_len, barrier, queue))
                 for i in range(clients)]
        for proc in procs:
            proc.start()
        got = [queue.get() for _ in procs]
        for proc in procs:
            proc.join()
        spans = [(t0, t1) for t0, t1, _ in got]
        outs = [o for _, _, part in got for o in part]
    wall = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)
    out_tokens = sum(n for n, _, _, _ in outs)
    in_tokens = sum(len(p) for p in prompts)
    ttft = [t for _, t, _, _ in outs]
    tpot = [t for n, _, t, _ in outs if n > 1]
    all_gaps = [g for _, _, _, gaps in outs for g in gaps]
    itl = stats(all_gaps)
    return {"wall_s": wall, "output_tok_s": out_tokens / wall,
            "total_tok_s": (out_tokens + in_tokens) / wall, "output_tokens": out_tokens,
            "ttft_ms_mean": 1e3 * statistics.fmean(ttft),
            "ttft_ms_p50": 1e3 * statistics.median(ttft),
            "tpot_ms_mean": 1e3 * statistics.fmean(tpot) if tpot else 0.0,
            "tpot_ms_p50": 1e3 * statistics.median(tpot) if tpot else 0.0,
            "itl_ms_p50": 1e3 * itl["p50"], "itl_ms_p99": 1e3 * itl["p99"],
            "itl_ms_max": 1e3 * max(all_gaps, default=float("nan"))}


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
    ap.add_argument("--clients", type=int, default=1,
                    help="client processes sharing the requests, each on its own connection "
                         "(use with --extra '--api-processes N')")
    ap.add_argument("--traces", default="off", choices=("off", "on", "both"),
                    help="OpenTelemetry tracing of every request (gateway off: router and "
                         "stages) exported to an OTLP sink in this process; both: each stage "
                         "count twice, off then on, for the overhead in one run")
    ap.add_argument("--metrics", default="on", choices=("on", "off", "both"),
                    help="the services' Prometheus endpoints (off: serve --no-metrics); "
                         "both: each stage count and tracing choice twice, on then off")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the whole set of meshes this many times, in the same order "
                         "(alternating rounds: a comparison's sides share the machine's "
                         "drift); each row carries its round")
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/throughput-{dt.date.today()}.json"))
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]
    config: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "out"}
    config |= {"tp": 1, "revision": git_revision()}  # each row: the hops' transports
    print(config, flush=True)
    rows = []
    on_off = {"off": (False,), "on": (True,), "both": (False, True)}
    variants = [(t, m) for t in on_off[args.traces] for m in on_off[args.metrics][::-1]]
    for round_ in range(args.repeat):
        for p in (int(x) for x in args.stages.split(",")):
            for traced, metrics in variants:
                rows.append({"round": round_, "stages": p, "traces": traced,
                             "metrics": metrics, **_measure(args, p, traced, metrics, prompts)})
                print(rows[-1], flush=True)
    for r in rows:  # against the first depth of its round, tracing and metrics as in it
        base = next(b for b in rows if all(b[k] == r[k] for k in ("round", "traces", "metrics")))
        r["vs_1_stage"] = r["output_tok_s"] / base["output_tok_s"]
    write_json(args.out, config, rows)
    print_table([{k: v for k, v in r.items() if k not in ("stage_figures", "cpu_s")}
                 for r in rows])
    for r in rows:
        print(f"round {r['round']} stages {r['stages']} traces {r['traces']} metrics "
              f"{r['metrics']}: CPU s {r['cpu_s']}")
    png = args.out.with_suffix(".png")
    plain = [r for r in rows if r["round"] == 0 and not r["traces"] and r["metrics"]]
    if plot_throughput(plain or rows, png, config):
        print(f"wrote {png}")


def _measure(args: argparse.Namespace, stages: int, traced: bool, metrics: bool,
             prompts: list[list[int]]) -> dict[str, Any]:
    """One mesh of `stages`, one run of the workload: its figures."""
    flags = ["--model", args.model, "--stages", str(stages), "--device", args.device,
             "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             *([] if metrics else ["--no-metrics"]), *args.extra.split()]
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(OtlpSink()) if traced else None
        if sink is not None:
            flags += ["--otlp-traces-endpoint", sink.endpoint]
        with Mesh(*flags, timeout=900) as mesh:
            before = process_cpu(mesh.proc.proc.pid)
            info = model_info(mesh.address)
            row = {"hop_transports": list(info.hop_transports),
                   "micro_batches": info.micro_batches,
                   **run(mesh.address, prompts, args.output_len, args.clients)}
            after = process_cpu(mesh.proc.proc.pid)
            # CPU seconds of each part of the mesh over the run (its warm-up requests too)
            row["cpu_s"] = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}
            row["stage_figures"] = stage_figures(mesh.address)  # the run's last 10 s
        if sink is not None:
            row["spans_exported"] = dict(sink.spans)
    return row


def plot_throughput(rows: list[dict[str, Any]], png: Path, config: dict[str, Any]) -> bool:
    """Output tok/s against pipeline depth (W4), and each stage's bubble at each depth;
    False (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    depths = [r["stages"] for r in rows]
    left.plot(depths, [r["output_tok_s"] for r in rows], marker="o")
    for r in rows:
        left.annotate(f"{r['vs_1_stage']:.2f}x", (r["stages"], r["output_tok_s"]),
                      textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    left.set_xticks(depths)
    left.set_ylim(bottom=0)
    left.set_xlabel("pipeline stages")
    left.set_ylabel("output tok/s")
    left.set_title("Throughput against stages")
    width = 0.8 / max(depths)
    for r in rows:
        bubbles = [100 * f["bubble"] for f in r.get("stage_figures", [])]
        xs = [r["stages"] + (i - (len(bubbles) - 1) / 2) * width for i in range(len(bubbles))]
        right.bar(xs, bubbles, width=width * 0.9)
        for x, b, i in zip(xs, bubbles, range(len(bubbles)), strict=True):
            right.annotate(f"s{i}", (x, b), textcoords="offset points", xytext=(0, 2),
                           ha="center", fontsize=7)
    right.set_xticks(depths)
    right.set_ylim(0, 100)
    right.set_xlabel("pipeline stages")
    right.set_ylabel("% of the last 10 s waiting for input")
    right.set_title("Pipeline bubble per stage")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(f"{Path(str(config.get('model'))).name}, {config.get('requests')} requests "
                 f"{config.get('prompt_len')}/{config.get('output_len')}, "
                 f"{config.get('device')}, rev {config.get('revision')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    main()
