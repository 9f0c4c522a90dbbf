"""Cross-check of W5's HTTP figures with guidellm, a maintained serving benchmark client.

One mesh with its gateway (the flags of `benchmarks.serving`) and one seeded Poisson schedule
at `--rate` (both clients together) whose requests alternate ABBA between
`benchmarks.serving`'s HTTP path (streamed /v1/completions) and `guidellm run` (its
`openai_http` backend on /v1/completions, its `replay` profile fed a trace of its half of
the schedule), so that both clients see the same load at the same moments, as the two paths
of `benchmarks.serving` do. guidellm starts first; its `--warmup` warm-up requests go
`--warmup-spacing` apart, and the moment the first reaches the router (polled over gRPC
GetStats) is both clients' time 0. Same prompt and output lengths (EOS ignored); guidellm's
prompts are synthetic text of `--prompt-len` tokens under the served model's own tokenizer,
read from the model directory (no hub access); ours are `benchmarks.serving`'s
(`--prompt-kind`: token ids, which skip the front's tokenization, or text that the front
tokenizes as it does guidellm's). `--rounds` runs more schedules.

Three columns per round:
- ours: `benchmarks.serving`'s figures (vLLM `bench serve` definitions).
- guidellm (recomputed): guidellm's own per-request timings (its send, first and last
  content chunk, output tokens from the usage chunk) under the same definitions and
  percentiles; its warm-up requests (the earliest sent) left out. guidellm keeps no
  per-chunk times, so its ITL is only the mean gap (all gaps of all requests). Its send
  time is its first header write, after opening any new connection; ours (and vLLM's) is
  taken before the request.
- guidellm (reported): what guidellm itself prints. It windows requests by time (TTFT by
  first-token time, after its warm-up), so it may count fewer; its percentiles are nearest
  rank. Its ITL is vLLM's TPOT, (last - first) / (tokens - 1) per request, counted once
  per token: with every output of the same length that is our TPOT distribution (shown in
  the TPOT lines), and its mean is the mean chunk gap (our ITL mean, a chunk carrying one
  token). Its own TPOT, (last - send) / tokens, includes the TTFT: in the JSON only.

guidellm's first token is its first chunk, and the gateway streams a chunk only when it
has something to show: a token that decodes to no text (part of a character; with random
weights, an id beyond the tokenizer's vocabulary) adds nothing for guidellm, where our
client asks for `return_token_ids` and counts it. So ours also has "TTFT to first text",
from send to the first chunk with text (`--temperature` as guidellm's requests, which
sample at 1.0, for that comparison: a greedy row of random weights may never show text).

guidellm needs its own environment (it pins its own dependencies and pulls in torch,
datasets and sanic), e.g. `python -m venv /tmp/gl && /tmp/gl/bin/pip install guidellm`:

    python -m benchmarks.serving_crosscheck --guidellm /tmp/gl/bin/guidellm --rate 1 \\
        --requests 40 --prompt-len 64 --output-len 16 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import print_table, write_json
from benchmarks.serving import (
    abba,
    add_mesh_args,
    base_config,
    clients,
    run_rate,
    schedule,
    serve_flags,
    served,
)
from benchmarks.serving_metrics import LATENCIES, stats, summarize
from foundation.modelstore import resolve_model
from stagemesh.local_mesh import Mesh, free_port


def guidellm_scenario(args: argparse.Namespace, times: list[float], target: str, model: str,
                      tokenizer: Path, workdir: Path) -> dict[str, Any]:
    """A guidellm scenario replaying requests at `times` (s after its start; the first
    args.warmup are its warm-up) from a trace of (timestamp, input_length, output_length)
    rows; prompts of synthetic text. It ends when the trace does."""
    trace = workdir / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": args.prompt_len,
                                         "output_length": args.output_len}) + "\n"
                             for t in times))
    return {
        "metadata": {"name": "stagemesh-w5-crosscheck",
                     "description": "W5 HTTP path: its half of an interleaved schedule"},
        "spec": {
            "backend": {"kind": "openai_http", "target": target, "model": model,
                        "request_format": "/v1/completions", "timeout": 3600},
            "profile": {"kind": "replay", "schedule_turn": "timestamp",
                        "warmup": {"mode": "requests", "value": args.warmup}},
            "data": [{"kind": "trace_synthetic",
                      "source": {"kind": "json_file", "path": str(trace)}}],
            "tokenizer": {"kind": "hf_auto", "model": str(tokenizer)},
            "seed": {"kind": "static", "value": args.seed},
            "outputs": [{"kind": "json", "path": str(workdir / "out.json")}],
        },
    }


async def start_guidellm(exe: str, scenario: dict[str, Any], workdir: Path
                         ) -> asyncio.subprocess.Process:
    path = workdir / "scenario.json"
    path.write_text(json.dumps(scenario, indent=2))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with (workdir / "guidellm.log").open("w") as log:
        return await asyncio.create_subprocess_exec(
            exe, "run", "-c", str(path), "--disable-progress", cwd=workdir, env=env,
            stdout=log, stderr=subprocess.STDOUT)


def guidellm_result(proc: asyncio.subprocess.Process, workdir: Path) -> dict[str, Any]:
    """The one benchmark of a finished `guidellm run`."""
    if proc.returncode != 0:
        log = (workdir / "guidellm.log").read_text()
        raise SystemExit(f"guidellm failed (exit {proc.returncode}):\n{log[-4000:]}")
    return dict(json.loads((workdir / "out.json").read_text())["benchmarks"][0])


async def interleaved_round(mesh: Mesh, args: argparse.Namespace, index: int,
                            tokenizer: Path, workdir: Path
                            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One Poisson schedule of 2 x args.requests at args.rate, its requests alternating
    (ABBA) between our client and guidellm. guidellm starts first: its warm-up requests go
    args.warmup_spacing apart; once the first reaches the router (its t = 0), our client
    takes its own half of the schedule from the same origin. (our row, guidellm's record)"""
    assert mesh.gateway_url is not None
    arrivals = schedule(args.seed, index, args.rate, 2 * args.requests)
    who = abba(["ours", "guidellm"], len(arrivals))
    mine = [t for t, w in zip(arrivals, who, strict=True) if w == "ours"]
    lead = args.warmup * args.warmup_spacing
    theirs = [i * args.warmup_spacing for i in range(args.warmup)] + [
        lead + t for t, w in zip(arrivals, who, strict=True) if w == "guidellm"]
    # guidellm 0.8 drops the last request of a replayed trace: one more, not measured
    theirs.append(theirs[-1] + 0.001)
    procs: list[asyncio.subprocess.Process] = []
    async with clients(mesh) as (client, http):
        info = await client.model_info()
        scenario = guidellm_scenario(args, theirs, mesh.gateway_url, info.model, tokenizer,
                                     workdir)

        async def ready() -> float:
            """Starts guidellm; its t = 0 + lead, on our clock."""
            procs.append(await start_guidellm(args.guidellm, scenario, workdir))
            deadline = time.perf_counter() + 600
            while True:
                st = await client.stats()
                if st.num_running + st.num_waiting > 0:
                    return time.perf_counter() + lead
                if procs[0].returncode is not None or time.perf_counter() > deadline:
                    await procs[0].wait()
                    raise SystemExit("guidellm sent no request:\n"
                                     + (workdir / "guidellm.log").read_text()[-4000:])
                await asyncio.sleep(0.005)

        _, results, duration = await run_rate(client, http, info.model, info.vocab_size,
                                              args, args.rate, index, mine, ready)
        await procs[0].wait()
    row = summarize("ours (http)", results, duration, args.output_len, args.ttft_slo_ms,
                    args.tpot_slo_ms)
    row["prompt_tokens_mean"] = float(args.prompt_len)
    row["ttft_count"] = row["ok"]
    # TTFT from the first header write, where guidellm starts its clock
    row |= {f"ttft_write_ms_{k}": v for k, v in stats(
        [(r.chunks[0] - r.wrote) * 1e3 for r in results
         if r.error is None and r.chunks and r.wrote is not None]).items()}
    # TTFT to the first chunk with text: the only first token guidellm can see
    texted = [(r.texted - r.sent) * 1e3 for r in results
              if r.error is None and r.texted is not None]
    row |= {f"ttft_text_ms_{k}": v for k, v in stats(texted).items()}
    row["ttft_text_count"] = len(texted)
    return row, guidellm_result(procs[0], workdir)


def guidellm_recomputed(bench: dict[str, Any], warmup: int, requests: int, out_len: int,
                        ttft_slo_ms: float, tpot_slo_ms: float) -> dict[str, Any]:
    """guidellm's per-request timings under `benchmarks.serving`'s definitions: by send
    time, the first `warmup` are its warm-up, the next `requests` are measured (any later
    one pads the trace)."""
    reqs = bench["requests"]
    everything = [(r, status) for status in ("successful", "errored", "incomplete")
                  for r in reqs[status]]
    def started(rs: tuple[dict[str, Any], str]) -> float:
        start = rs[0]["info"]["timings"]["request_start"]
        return float("inf") if start is None else float(start)

    everything.sort(key=started)
    measured = everything[warmup:warmup + requests]
    ok = [r for r, status in measured if status == "successful"
          and r["info"]["timings"]["first_token_iteration"] is not None]
    timings = [r["info"]["timings"] for r in ok]
    tokens = [int(r["output_metrics"]["text_tokens"] or 0) for r in ok]
    ttft = [(t["first_token_iteration"] - t["request_start"]) * 1e3 for t in timings]
    tpot = [(t["last_token_iteration"] - t["first_token_iteration"]) * 1e3 / (n - 1)
            if n > 1 else 0.0 for t, n in zip(timings, tokens, strict=True)]
    span = sum((t["last_token_iteration"] - t["first_token_iteration"]) * 1e3
               for t in timings)
    gaps = sum(max(n - 1, 0) for n in tokens)
    start = min((t["request_start"] for t in timings), default=0.0)
    end = max((t["request_end"] for t in timings), default=1.0)
    duration = end - start
    good = sum(1 for a, b in zip(ttft, tpot, strict=True)
               if a <= ttft_slo_ms and b <= tpot_slo_ms)
    row: dict[str, Any] = {
        "path": "guidellm (recomputed)", "requests": len(measured), "ok": len(ok),
        "failed": len(measured) - len(ok),
        "short": sum(1 for n in tokens if n != out_len), "duration_s": duration,
        "req_s": len(ok) / duration, "out_tok_s": sum(tokens) / duration,
        "prompt_tokens_mean": float(np.mean([r["input_metrics"]["text_tokens"] or 0
                                             for r in ok])) if ok else float("nan")}
    # One clock for all three: its first chunk is its first token, sent when its write
    # began, and every chunk it counts has text.
    ttft_stats = stats(ttft)
    for name in ("ttft", "ttft_write", "ttft_text"):
        row |= {f"{name}_ms_{k}": v for k, v in ttft_stats.items()}
    row["ttft_text_count"] = len(ok)
    row |= {f"tpot_ms_{k}": v for k, v in stats(tpot).items()}
    # No per-chunk times in guidellm's records: only the chunk-weighted mean gap.
    row["itl_ms_mean"] = span / gaps if gaps else float("nan")
    row["ttft_count"] = len(ok)
    errors = sorted({str(r["info"].get("error")) for r, status in measured
                     if status != "successful"})
    if errors:
        row["errors"] = errors[:5]
    row["goodput_pct"] = 100.0 * good / len(measured) if measured else float("nan")
    row["goodput_req_s"] = good / duration
    return row


def guidellm_reported(bench: dict[str, Any]) -> dict[str, Any]:
    """guidellm's own summary (successful requests in its measurement window)."""
    m = bench["metrics"]

    def dist(key: str) -> dict[str, Any]:
        return dict(m[key]["successful"])

    row: dict[str, Any] = {"path": "guidellm (reported)",
                           "ok": dist("request_latency")["count"],
                           "ttft_count": dist("time_to_first_token_ms")["count"],
                           "duration_s": bench["duration"],
                           "req_s": dist("requests_per_second")["mean"],
                           "out_tok_s": dist("output_tokens_per_second")["mean"],
                           "prompt_tokens_mean": dist("prompt_token_count")["mean"]}
    # guidellm's ITL is vLLM's TPOT, one entry per token: with every request of the same
    # output length, the same distribution as ours; its mean is also the mean chunk gap.
    for ours, theirs in (("ttft_ms", "time_to_first_token_ms"),
                         ("tpot_ms", "inter_token_latency_ms")):
        d = dist(theirs)
        row |= {f"{ours}_mean": d["mean"], f"{ours}_p50": d["percentiles"]["p50"],
                f"{ours}_p99": d["percentiles"]["p99"]}
    row["itl_ms_mean"] = row["tpot_ms_mean"]
    d = dist("time_per_output_token_ms")
    row["tpot_incl_ttft_ms_mean"] = d["mean"]  # guidellm's TPOT: (last - send) / tokens
    return row


def side_by_side(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per figure, one column per source, and ours / guidellm (recomputed)."""
    figures = [("requests ok", "ok", "{:.0f}"), ("of which in TTFT", "ttft_count", "{:.0f}"),
               ("prompt tokens (mean)", "prompt_tokens_mean", "{:.1f}"),
               ("req/s", "req_s", "{:.3g}"), ("output tok/s", "out_tok_s", "{:.3g}")]
    for name in LATENCIES:
        figures += [(f"{name[:-3].upper()} {k} (ms)", f"{name}_{k}", "{:.1f}")
                    for k in ("mean", "p50", "p99")]
    figures += [(f"TTFT from header write {k} (ms)", f"ttft_write_ms_{k}", "{:.1f}")
                for k in ("mean", "p50", "p99")]
    figures += [("of which with text", "ttft_text_count", "{:.0f}")]
    figures += [(f"TTFT to first text {k} (ms)", f"ttft_text_ms_{k}", "{:.1f}")
                for k in ("mean", "p50", "p99")]
    figures += [("send lag mean (ms)", "send_lag_ms_mean", "{:.2f}"),
                ("send lag p99 (ms)", "send_lag_ms_p99", "{:.2f}"),
                ("goodput %", "goodput_pct", "{:.0f}")]
    out = []
    for label, key, fmt in figures:
        line: dict[str, Any] = {"figure": label}
        for r in rows:
            value = r.get(key)
            line[r["path"]] = "-" if value is None else fmt.format(value)
        a, b = rows[0].get(key), rows[1].get(key)
        line["ours/guidellm"] = f"{a / b:.2f}" if key.endswith(("mean", "p50", "p99", "_s")) \
            and a is not None and b else ""
        out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_mesh_args(ap)
    ap.add_argument("--rate", type=float, default=1.0,
                    help="Poisson arrivals, req/s, both clients together")
    ap.add_argument("--requests", type=int, default=40, help="measured, per client")
    ap.add_argument("--warmup", type=int, default=2,
                    help="unmeasured requests first, per client (at least 1)")
    ap.add_argument("--warmup-spacing", type=float, default=3.0,
                    help="seconds between guidellm's warm-up requests, and from the last "
                         "one to the measured schedule")
    ap.add_argument("--rounds", type=int, default=1, help="one schedule each")
    ap.add_argument("--guidellm", default=shutil.which("guidellm") or "guidellm",
                    help="the guidellm executable (its own environment)")
    ap.add_argument("--ttft-slo-ms", type=float, default=150.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=15.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.paths = ["http"]
    if args.warmup < 1:
        ap.error("--warmup must be at least 1: guidellm's first request starts the clock")
    if args.out is None:
        args.out = Path(f"benchmarks/results/w5-crosscheck-{args.device}-{dt.date.today()}"
                        ".json")
    version = subprocess.run([args.guidellm, "--version"], capture_output=True, text=True)
    if version.returncode != 0:
        raise SystemExit(f"cannot run guidellm ({args.guidellm}): {version.stderr.strip()}")
    config = base_config(args, "W5 cross-check (HTTP path) with guidellm")
    config |= {"rate_req_s": args.rate, "arrivals": "Poisson, seeded",
               "order": "one schedule, requests alternating ABBA between the two clients",
               "requests_per_client": args.requests, "warmup": args.warmup,
               "warmup_spacing_s": args.warmup_spacing, "rounds": args.rounds,
               "guidellm": version.stdout.strip(),
               "guidellm_prompts": "synthetic text, served model's tokenizer",
               "goodput_slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms},
               "python": sys.version.split()[0]}
    print(json.dumps(config, indent=2), flush=True)
    rows: list[dict[str, Any]] = []
    with Mesh(*serve_flags(args), gateway_port=free_port(),
              timeout=args.startup_timeout) as mesh:

        async def model_info() -> Any:
            async with clients(mesh) as (client, _):
                return await client.model_info()

        config["served"] = served(asyncio.run(model_info()))
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}: ours and guidellm interleaved, {args.rate:g} req/s in "
                  f"all", flush=True)
            # guidellm's trace, scenario, log and JSON (every request's timings)
            work = args.out.with_name(f"{args.out.stem}-guidellm-r{rnd + 1}")
            work.mkdir(parents=True, exist_ok=True)
            mine, bench = asyncio.run(interleaved_round(mesh, args, rnd,
                                                        resolve_model(args.model), work))
            new = [{"round": rnd + 1, **r} for r in (
                mine, guidellm_recomputed(bench, args.warmup, args.requests,
                                          args.output_len, args.ttft_slo_ms,
                                          args.tpot_slo_ms),
                guidellm_reported(bench))]
            rows += new
            print_table(side_by_side(new))
            write_json(args.out, config, rows)
    if args.rounds > 1:
        rows.append(median_ratio(rows))
        print("ours / guidellm (recomputed), median over the rounds:")
        print_table([{k: v for k, v in rows[-1].items() if k != "path"}])
        write_json(args.out, config, rows)


def median_ratio(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """ours / guidellm (recomputed) for each figure, the median over the rounds."""
    mine = [r for r in rows if r["path"] == "ours (http)"]
    theirs = [r for r in rows if r["path"] == "guidellm (recomputed)"]
    out: dict[str, Any] = {"path": "ours/guidellm (recomputed), median over rounds"}
    for key in ("req_s", "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_mean",
                "tpot_ms_p50", "tpot_ms_p99", "itl_ms_mean"):
        out[key] = float(np.median([a[key] / b[key] for a, b in zip(mine, theirs,
                                                                    strict=True)]))
    return out


if __name__ == "__main__":
    main()
