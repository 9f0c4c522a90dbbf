"""Overload and soak: what the mesh does at 10x the load it can sustain, and over time.

Three phases against one `stagemesh serve`, then an optional soak:

1. sustain: `--concurrency` clients in a closed loop for `--duration` s; the completion rate
   is the sustainable rate R (requests/s the mesh finishes when it is kept busy).
2. overload: Poisson arrivals at `--factor` x R for `--duration` s. The router's admission
   limits (`--max-queued-requests`, `--max-queued-tokens`) must refuse the excess at once
   (RESOURCE_EXHAUSTED with retry-after) while every admitted request finishes.
3. recover: Poisson arrivals at R / 2 for `--duration` s: nothing refused, latency back near
   the sustain phase's.
4. soak (`--soak S`): R / 2 for S more seconds, mixed traffic: of the arrivals, a seeded
   `--soak-cancel` share cancel their gRPC call after a few tokens and a `--soak-disconnect`
   share stream through the gateway (`/v1/completions`) and drop the connection after a few
   chunks; the rest stream to the end over gRPC. The resident memory of every process is
   fitted to a line (MB per minute after the first 20 %); latency is reported for the soak's
   first and last minute.

Resident memory (VmRSS) and open file descriptors of the router, its engine core, each stage
and the gateway are sampled every 0.5 s throughout; KV in use on the router after every phase
has drained. Requests are random token ids with EOS ignored (every admitted one generates
`--output-len` tokens).

    python -m benchmarks.overload --stages 2 --duration 20 --soak 120 \\
        --out benchmarks/results/overload-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import numpy as np

from benchmarks.report import print_table, write_json
from benchmarks.serving import FIRST_ORDINARY_ID, add_mesh_args, base_config, serve_flags
from benchmarks.serving_metrics import stats
from router.client import RouterClient
from stagemesh.local_mesh import Mesh, free_port

REFUSED = grpc.StatusCode.RESOURCE_EXHAUSTED.name


@dataclass
class Outcome:
    """One request as the client saw it; `kind`: "stream", "cancel" (the client cancelled
    it after `CUT_AFTER` tokens) or "disconnect" (an HTTP stream dropped after as many)."""

    sent: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    status: str = "OK"
    detail: str = ""
    retry_after: str | None = None
    kind: str = "stream"


CUT_AFTER = 4  # tokens (or HTTP chunks) before a cancel or a disconnect


class ClientPool:
    """Requests spread over several connections, as many clients would (one HTTP/2
    connection carries a bounded number of concurrent calls)."""

    def __init__(self, clients: list[RouterClient]) -> None:
        self.clients = clients
        self._next = 0

    def pick(self) -> RouterClient:
        self._next = (self._next + 1) % len(self.clients)
        return self.clients[self._next]


async def request(pool: ClientPool, prompt: list[int], out_len: int,
                  cancel: bool = False) -> Outcome:
    o = Outcome(time.perf_counter(), kind="cancel" if cancel else "stream")
    try:
        async for chunk in pool.pick().generate(token_ids=prompt, max_tokens=out_len,
                                           ignore_eos=True, temperature=0.0, timeout=600):
            if chunk.token_ids:
                o.first = o.first or time.perf_counter()
                o.tokens += len(chunk.token_ids)
            if cancel and o.tokens >= CUT_AFTER:
                break  # leaving the stream cancels the call on the router
    except grpc.aio.AioRpcError as e:
        o.status = e.code().name
        o.detail = e.details() or ""
        o.retry_after = dict(e.trailing_metadata() or ()).get("retry-after")
    o.end = time.perf_counter()
    return o


async def closed_loop(client: ClientPool, prompts: list[list[int]], out_len: int,
                      concurrency: int, duration: float) -> list[Outcome]:
    """`concurrency` clients, each sending its next request when the last one ends."""
    stop = time.perf_counter() + duration
    done: list[Outcome] = []

    async def worker(w: int) -> None:
        i = w
        while time.perf_counter() < stop:
            done.append(await request(client, prompts[i % len(prompts)], out_len))
            i += concurrency
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done


async def disconnect(http: httpx.AsyncClient, model: str, prompt: list[int],
                     out_len: int) -> Outcome:
    """A streamed `/v1/completions` through the gateway whose client drops the connection
    after `CUT_AFTER` chunks."""
    o = Outcome(time.perf_counter(), kind="disconnect")
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                o.status = f"HTTP {response.status_code}"
            else:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        o.first = o.first or time.perf_counter()
                        o.tokens += 1
                        if o.tokens >= CUT_AFTER:
                            break  # closing the response drops the connection
    except httpx.HTTPError as e:
        o.status, o.detail = "HTTP error", repr(e)
    o.end = time.perf_counter()
    return o


async def open_loop(client: ClientPool, prompts: list[list[int]], out_len: int,
                    rate: float, duration: float, rng: np.random.Generator,
                    http: tuple[httpx.AsyncClient, str] | None = None, cancel: float = 0.0,
                    drop: float = 0.0) -> list[Outcome]:
    """Poisson arrivals at `rate` for `duration`; returns once every request ended. A
    `cancel` share of the arrivals cancel after a few tokens, a `drop` share disconnect
    from the gateway (`http`: a client of it and the model name) after a few chunks."""
    start = time.perf_counter()
    tasks: list[asyncio.Task[Outcome]] = []
    at = 0.0
    while at < duration:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        prompt = prompts[len(tasks) % len(prompts)]
        draw = float(rng.random())
        if http is not None and draw < drop:
            tasks.append(asyncio.create_task(disconnect(*http, prompt, out_len)))
        else:
            tasks.append(asyncio.create_task(request(client, prompt, out_len,
                                                     cancel=draw < drop + cancel)))
        at += float(rng.exponential(1.0 / rate))
    return list(await asyncio.gather(*tasks))


def phase_row(name: str, outcomes: list[Outcome], duration: float, out_len: int
              ) -> dict[str, Any]:
    cut = [o for o in outcomes if o.kind != "stream"]
    outcomes = [o for o in outcomes if o.kind == "stream"]
    ok = [o for o in outcomes if o.status == "OK"]
    refused = [o for o in outcomes if o.status == REFUSED]
    e2e = stats([1e3 * (o.end - o.sent) for o in ok if o.end])
    other = sorted({f"{o.status}: {o.detail[:80]}" for o in outcomes
                    if o.status not in ("OK", REFUSED)})[:3]
    return {
        "phase": name, "offered_rps": len(outcomes) / duration, "sent": len(outcomes),
        "finished": len(ok), "complete": sum(o.tokens == out_len for o in ok),
        "refused": len(refused),
        "refused_with_retry_after": sum(o.retry_after is not None for o in refused),
        "other_errors": sum(o.status not in ("OK", REFUSED) for o in outcomes),
        "other_error_kinds": other,
        "finished_rps": len(ok) / duration,
        "e2e_p50_ms": e2e["p50"], "e2e_p99_ms": e2e["p99"],
        "ttft_p50_ms": stats([1e3 * (o.first - o.sent) for o in ok if o.first])["p50"],
        "refusal_p99_ms": stats([1e3 * (o.end - o.sent) for o in refused if o.end])["p99"],
        "cancelled": sum(o.kind == "cancel" for o in cut),
        "disconnected": sum(o.kind == "disconnect" for o in cut),
        "cut_with_errors": sum(o.status != "OK" for o in cut),
    }


def window_rows(outcomes: list[Outcome], out_len: int, seconds: float = 60.0
                ) -> list[dict[str, Any]]:
    """Latency of the whole streams sent in the phase's first and last `seconds`."""
    sent = [o.sent for o in outcomes]
    if not sent:
        return []
    first, last = min(sent), max(sent)
    rows = []
    for name, keep in (("first minute", lambda o: o.sent < first + seconds),
                       ("last minute", lambda o: o.sent > last - seconds)):
        picked = [o for o in outcomes if keep(o)]
        rows.append(phase_row(f"soak, {name}", picked, seconds, out_len))
    return rows


@dataclass
class RssSampler:
    """VmRSS (MB) and open file descriptors of each named process every `period` s, with
    the phase they were taken in."""

    pids: dict[str, int]
    period: float = 0.5
    samples: list[tuple[float, str, dict[str, float]]] = field(default_factory=list)
    fds: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    phase: str = "start"

    async def run(self) -> None:
        while True:
            self.samples.append((time.perf_counter(), self.phase,
                                 {name: rss_mb(pid) for name, pid in self.pids.items()}))
            self.fds.append((self.phase, {name: open_fds(pid)
                                          for name, pid in self.pids.items()}))
            await asyncio.sleep(self.period)

    def summary(self) -> list[dict[str, Any]]:
        rows = []
        for name in self.pids:
            row: dict[str, Any] = {"process": name}
            for phase in ("start", "sustain", "overload", "recover", "soak"):
                values = [s[name] for _, p, s in self.samples if p == phase]
                if values:
                    row[f"{phase}_max_mb"] = max(values)
            row["end_mb"] = self.samples[-1][2][name]
            row["fds_start"] = self.fds[0][1][name]
            row["fds_max"] = max(f[name] for _, f in self.fds)
            row["fds_end"] = self.fds[-1][1][name]
            soak = [(t, s[name]) for t, p, s in self.samples if p == "soak"]
            if len(soak) >= 10:
                tail = soak[len(soak) // 5:]
                slope = np.polyfit([t for t, _ in tail], [v for _, v in tail], 1)[0]
                row["soak_mb_per_min"] = float(slope * 60)
            rows.append(row)
        return rows


def rss_mb(pid: int) -> float:
    """Resident memory of `pid` in MB (NaN once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def open_fds(pid: int) -> int:
    """Open file descriptors of `pid` (-1 once it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def mesh_pids(mesh: Mesh) -> dict[str, int]:
    """Every process of the mesh: serve's children and the router's engine core."""
    pids = dict(mesh.pids)
    out = subprocess.run(["pgrep", "-P", str(pids["router"]), "-f", "router.core.process"],
                         capture_output=True, text=True, check=False)
    if out.stdout.split():
        pids["core"] = int(out.stdout.split()[0])
    return pids


async def measure(mesh: Mesh, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(FIRST_ORDINARY_ID, 40000) for _ in range(args.prompt_len)]
               for _ in range(256)]
    sampler = RssSampler(mesh_pids(mesh))
    sampling = asyncio.create_task(sampler.run())
    phases = []
    try:
        async with contextlib.AsyncExitStack() as stack:
            client = ClientPool([await stack.enter_async_context(
                RouterClient(mesh.address, own_connection=True))
                for _ in range(args.connections)])
            http = None  # the soak's dropped HTTP streams need the gateway
            if mesh.gateway_url is not None:
                http = (await stack.enter_async_context(httpx.AsyncClient(
                    base_url=mesh.gateway_url, timeout=600)),
                    (await client.clients[0].model_info(timeout=30)).model)
            kv_after: dict[str, int] = {}
            await closed_loop(client, prompts, args.output_len, 2, 2.0)  # warm-up
            sampler.phase = "sustain"
            sustained = await closed_loop(client, prompts, args.output_len, args.concurrency,
                                          args.duration)
            phases.append(phase_row("sustain", sustained, args.duration, args.output_len))
            rate = max(phases[0]["finished_rps"], 0.1)
            print(f"sustainable: {rate:.2f} req/s", flush=True)
            np_rng = np.random.default_rng(args.seed)
            for name, factor, duration in (("overload", args.factor, args.duration),
                                           ("recover", 0.5, args.duration),
                                           ("soak", 0.5, args.soak)):
                if duration <= 0:
                    continue
                sampler.phase = name
                soak = name == "soak"
                outcomes = await open_loop(
                    client, prompts, args.output_len, factor * rate, duration, np_rng,
                    http if soak else None, args.soak_cancel if soak else 0.0,
                    args.soak_disconnect if soak else 0.0)
                phases.append(phase_row(name, outcomes, duration, args.output_len))
                if soak:
                    phases += window_rows(outcomes, args.output_len)
                print(phases[-1], flush=True)
                kv_after[name] = await idle_kv(client.clients[0])
            stats_after = await client.clients[0].stats()
    finally:
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
    return {"sustainable_rps": rate, "phases": phases, "rss": sampler.summary(),
            "kv_blocks_used_after_each_phase": kv_after,
            "idle_after": {"kv_blocks_used": stats_after.kv_blocks_used,
                           "num_running": stats_after.num_running,
                           "num_waiting": stats_after.num_waiting}}


async def idle_kv(client: RouterClient, wait_s: float = 20.0) -> int:
    """KV blocks still used on the router once a phase's requests ended (polled until 0,
    or what is left after `wait_s`: cancelled and disconnected calls free theirs at the
    next step)."""
    deadline = time.perf_counter() + wait_s
    while True:
        used = (await client.stats()).kv_blocks_used
        if not used or time.perf_counter() > deadline:
            return int(used)
        await asyncio.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_mesh_args(ap)
    ap.set_defaults(prompt_len=64, output_len=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    ap.add_argument("--factor", type=float, default=10.0, help="overload = factor x sustainable")
    ap.add_argument("--soak", type=float, default=0.0, help="soak seconds at half the rate")
    ap.add_argument("--soak-cancel", type=float, default=0.2,
                    help="share of the soak's arrivals that cancel after a few tokens")
    ap.add_argument("--soak-disconnect", type=float, default=0.2,
                    help="share of the soak's arrivals that stream through the gateway and "
                         "drop the connection after a few chunks")
    ap.add_argument("--max-queued-requests", type=int, default=32)
    ap.add_argument("--connections", type=int, default=16,
                    help="client connections the requests are spread over")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/overload.json"))
    args = ap.parse_args()
    flags = [*serve_flags(args), "--max-queued-requests", str(args.max_queued_requests)]
    config = {**base_config(args, "overload"), "serve_flags": " ".join(flags),
              "concurrency": args.concurrency, "duration_s": args.duration,
              "factor": args.factor, "soak_s": args.soak,
              "soak_cancel": args.soak_cancel, "soak_disconnect": args.soak_disconnect,
              "cut_after_tokens": CUT_AFTER,
              "max_queued_requests": args.max_queued_requests,
              "connections": args.connections}
    print(config, flush=True)
    with Mesh(*flags, timeout=args.startup_timeout, gateway_port=free_port()) as mesh:
        result = asyncio.run(measure(mesh, args))
    write_json(args.out, config, [result])
    print_table(result["phases"])
    print_table(result["rss"])
    print("KV in use after each phase:", result["kv_blocks_used_after_each_phase"])
    print("after:", result["idle_after"])


if __name__ == "__main__":
    main()
