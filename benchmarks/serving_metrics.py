"""The W5 figures from what the clients saw: per request the send time, each streamed
chunk's arrival and the token count (`Result`); per path and rate the latency statistics,
throughput and goodput (`summarize`), the ratio of two paths, and the printed table.

Metric definitions as vLLM's `bench serve`: TTFT from send to the first streamed token; TPOT
per request = (end - first token) / (output tokens - 1); ITL = gaps between streamed chunks;
percentiles by linear interpolation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms")


@dataclass
class Result:
    """One request as the client saw it: send time, arrival time of each streamed chunk that
    carried tokens, and the number of output tokens."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None
    wrote: float | None = None  # HTTP: when the request's headers began to go out
    texted: float | None = None  # when the first chunk with text arrived (a token may have none)


def stats(values: list[float]) -> dict[str, float]:
    """mean, p50, p99 (linear interpolation); NaN when there is nothing to measure."""
    arr = np.asarray(values or [float("nan")], dtype=float)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p99": float(np.percentile(arr, 99))}


def summarize(path: str, results: list[Result], duration: float, out_len: int,
              ttft_slo_ms: float, tpot_slo_ms: float) -> dict[str, Any]:
    """One table row: a path's requests at one rate."""
    ok = [r for r in results if r.error is None and r.chunks]
    ttft = [(r.chunks[0] - r.sent) * 1e3 for r in ok]
    # TPOT of a one-token output is 0 (vLLM), so it meets any TPOT objective.
    tpot = [(r.chunks[-1] - r.chunks[0]) * 1e3 / (r.tokens - 1) if r.tokens > 1 else 0.0
            for r in ok]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r.chunks, r.chunks[1:], strict=False)]
    good = sum(1 for a, b in zip(ttft, tpot, strict=True)
               if a <= ttft_slo_ms and b <= tpot_slo_ms)
    row: dict[str, Any] = {
        "path": path, "requests": len(results), "ok": len(ok),
        "failed": len(results) - len(ok),
        "short": sum(1 for r in ok if r.tokens != out_len),  # finished, not out_len tokens
        "duration_s": duration, "req_s": len(ok) / duration,
        "out_tok_s": sum(r.tokens for r in ok) / duration}
    for name, values in zip(LATENCIES, (ttft, tpot, itl), strict=True):
        row |= {f"{name}_{k}": v for k, v in stats(values).items()}
    row["goodput_pct"] = 100.0 * good / len(results) if results else float("nan")
    row["goodput_req_s"] = good / duration
    # The client's own delay from taking the send time to writing the request (a
    # new connection, or a busy client): large values mean the client, not the server.
    lag = [(r.wrote - r.sent) * 1e3 for r in ok if r.wrote is not None]
    if lag:
        row |= {f"send_lag_ms_{k}": v for k, v in stats(lag).items()}
    errors = sorted({r.error for r in results if r.error})
    if errors:
        row["errors"] = errors[:5]
    # Each request in send order: seconds after the path's first send, TTFT, TPOT (ms): where
    # in the schedule the tail sits (a burst of arrivals, the start, one long step).
    first = min((r.sent for r in ok), default=0.0)
    row["per_request"] = [[round(r.sent - first, 4), round(a, 2), round(b, 3)]
                          for r, a, b in sorted(zip(ok, ttft, tpot, strict=True),
                                                key=lambda x: x[0].sent)]
    return row


def ratio_row(rate: float, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """b / a for each latency and throughput figure (a: grpc, b: http)."""
    out: dict[str, Any] = {"rate": rate, "path": f"{b['path']}/{a['path']}"}
    for key, value in a.items():
        if key.endswith(("_mean", "_p50", "_p99", "req_s", "tok_s")) and value:
            out[key] = b[key] / value
    return out


def table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The printed view of the rows: latencies as mean / p50 / p99 in ms."""
    out = []
    for r in rows:
        ratio = "/" in r["path"]
        fmt = "{:.2f}" if ratio else "{:.1f}"
        view: dict[str, Any] = {"rate": r["rate"], "path": r["path"],
                                "ok": "" if ratio else r["ok"],
                                "failed": "" if ratio else r["failed"],
                                "req/s": r.get("req_s", ""),
                                "out tok/s": r.get("out_tok_s", "")}
        for name in LATENCIES:
            view[f"{name[:-3].upper()} mean/p50/p99"] = " / ".join(
                fmt.format(r[f"{name}_{k}"]) if f"{name}_{k}" in r else "-"
                for k in ("mean", "p50", "p99"))
        view["goodput"] = "" if ratio else \
            f"{r['goodput_pct']:.0f} % ({r['goodput_req_s']:.3g}/s)"
        out.append(view)
    return out
