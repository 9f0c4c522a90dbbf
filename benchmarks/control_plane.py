"""W6: the control-plane ceiling. Stages skip model compute (`--model-impl null`), so a step
costs only planning, gRPC plans/results, the data plane ([64, 576] fp32 = 147 KB of
activations per hop) and streaming tokens to clients. 64 sequences decode; steps/s is read
from the router's step counter over a window of steady decoding, for 1 and 2 stages in
the same run. Beside it, each part's CPU per step over the same window (from /proc: the
router's front 0, its engine core, each stage, and this process as the client), which
varies far less between runs on a shared machine than steps/s does, and the same over the
engine core's (`cpu_vs_engine_core_by_part`: the VM's speed moves every process together,
so a part whose code changed is compared by this ratio with its own in another round of
another tree, as long as the engine core's code is the same), each part's wake-ups a
step (a thread that blocked and was woken; on a machine of few cores a wake-up costs more
than most of the code it runs), each part's preemptions a step (a thread that could still
run had its core taken: a woken thread preempted it, or its slice ended), and, before and
after the run, the machine's Python speed (`report.python_ns_per_op`): W6 is bound by
Python on the CPU, so runs on other machines, or other hours of a shared VM, compare only
beside it.

The stages keep a micro-batch each in flight (`--micro-batches`, default one per stage, as W6
has run since it was defined), although serve's own default on one machine's cores is one
between them: W6 measures the pipeline's control plane with every stage busy. Give 0 for
serve's default.

The client, this process, shares the machine's cores with the mesh. It runs gRPC's own
defaults, as W6 always has (`--client-grpc default`), or, with `--client-grpc mesh`, the
gRPC core setting every mesh process runs (`foundation.grpc_core`), which costs a streamed
response less CPU and fewer wake-ups: then less of the step's CPU is the client's. The JSON
records which.

    python -m benchmarks.control_plane --stages 1,2 --out benchmarks/results/w6.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import (
    git_revision,
    preemptions,
    print_table,
    process_cpu,
    process_preemptions,
    process_wakeups,
    python_ns_per_op,
    wakeups,
    write_json,
)
from benchmarks.w6_floor import measure as measure_floor
from foundation.grpc_core import EXPERIMENTS_ENV, apply_defaults
from foundation.model_config import ModelConfig
from foundation.modelstore.store import resolve_model
from router.client import RouterClient
from stagemesh.local_mesh import Mesh

NUM_BLOCKS, BLOCK_SIZE = 8192, 16


async def steady_decode(address: str, requests: Sequence[dict[str, Any]], window_s: float,
                        settle_s: float = 0.5,
                        cpu: Callable[[], dict[str, float]] = dict,
                        woken: Callable[[], dict[str, float]] = dict,
                        probes: int = 0,
                        preempted: Callable[[], dict[str, float]] = dict) -> dict[str, Any]:
    """Keep one sequence decoding per entry of `requests` (`RouterClient.generate` keyword
    arguments; each is submitted again when it ends). Once all run and `settle_s` more has
    passed: the router's steps, the tokens streamed, the CPU seconds by part (`cpu()`, plus
    this process as "client"), the wake-ups by part (`woken()`, the same) and the
    preemptions by part (`preempted()`, the same) over `window_s`. Then `probes` one-token
    requests, one after another, each into the steady decode: their times to first token
    ("probe_ttft_ms"), which include the wait behind the steps planned before they came; and
    the transport of each hop between stages ("hop_transports", as the router reports it)."""
    async with RouterClient(address) as client:
        tokens = 0

        async def one(request: dict[str, Any]) -> None:
            nonlocal tokens
            while True:
                async for chunk in client.generate(**request):
                    tokens += len(chunk.token_ids)

        tasks = [asyncio.create_task(one(r)) for r in requests]
        try:
            while (await client.stats()).num_running < len(requests):  # all admitted
                await asyncio.sleep(0.05)
            await asyncio.sleep(settle_s)
            s0, t0, k0 = (await client.stats()).steps, time.perf_counter(), tokens
            c0 = {**cpu(), "client": time.process_time()}
            w0 = {**woken(), "client": wakeups(os.getpid())}
            p0 = {**preempted(), "client": preemptions(os.getpid())}
            await asyncio.sleep(window_s)
            c1 = {**cpu(), "client": time.process_time()}
            w1 = {**woken(), "client": wakeups(os.getpid())}
            p1 = {**preempted(), "client": preemptions(os.getpid())}
            s1, t1, k1 = (await client.stats()).steps, time.perf_counter(), tokens
            ttft = [await _probe(client, i) for i in range(probes)]
            hops = list((await client.model_info()).hop_transports)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {"steps": s1 - s0, "seconds": t1 - t0, "tokens": k1 - k0,
            "cpu_s": {part: c1[part] - c0.get(part, 0.0) for part in sorted(c1)},
            "wakeups": {part: w1[part] - w0.get(part, 0) for part in sorted(w1)},
            "preemptions": {part: p1[part] - p0.get(part, 0) for part in sorted(p1)},
            "probe_ttft_ms": ttft, "hop_transports": hops}


async def _probe(client: RouterClient, i: int) -> float:
    """The time to first token of a one-token request sent now (ms), after a pause that
    lands it at some other point of the step rhythm."""
    await asyncio.sleep(0.01 + 0.003 * (i % 7))
    start = time.perf_counter()
    async for _ in client.generate(prompt=f"probe {i}", max_tokens=1, temperature=0.0):
        return (time.perf_counter() - start) * 1e3
    raise RuntimeError("a probe request streamed nothing")


async def measure(address: str, seqs: int, window_s: float,
                  cpu: Callable[[], dict[str, float]],
                  woken: Callable[[], dict[str, float]] = dict,
                  probes: int = 0,
                  preempted: Callable[[], dict[str, float]] = dict) -> dict[str, Any]:
    """W6: `seqs` sequences decoding (`steady_decode`); steps/s, tokens streamed per second
    and each part's CPU, wake-ups and preemptions per step, then `probes` requests' times to
    first token (median and largest). A request is as long as the KV pool lets every
    sequence be (no preemption)."""
    max_tokens = min(4000, NUM_BLOCKS * BLOCK_SIZE // seqs - 2 * BLOCK_SIZE)
    requests = [dict(prompt=f"request {i}", max_tokens=max_tokens, ignore_eos=True,
                     temperature=0.0) for i in range(seqs)]
    got = await steady_decode(address, requests, window_s, cpu=cpu, woken=woken, probes=probes,
                              preempted=preempted)
    steps = max(got["steps"], 1)
    steps_s = got["steps"] / got["seconds"]
    cpu_us = {part: round(s * 1e6 / steps) for part, s in got["cpu_s"].items()}
    woke = {part: round(n / steps, 2) for part, n in got["wakeups"].items()}
    taken = {part: round(n / steps, 2) for part, n in got["preemptions"].items()}
    return {"hop_transports": got["hop_transports"],
            "steps_per_s": steps_s, "us_per_step": 1e6 / steps_s,
            "tokens_per_s": got["tokens"] / got["seconds"],
            "cpu_us_per_step": sum(cpu_us.values()), "cpu_us_per_step_by_part": cpu_us,
            "cpu_vs_engine_core_by_part": cpu_over(cpu_us, "engine core"),
            "wakeups_per_step": round(sum(woke.values()), 2),
            "wakeups_per_step_by_part": woke,
            "preemptions_per_step": round(sum(taken.values()), 2),
            "preemptions_per_step_by_part": taken,
            **({"probe_ttft_ms_p50": round(statistics.median(ttft), 2),
                "probe_ttft_ms_max": round(max(ttft), 2)} if (ttft := got["probe_ttft_ms"])
               else {})}


def cpu_over(cpu_us: dict[str, int], part: str) -> dict[str, float]:
    """Every other part's CPU a step over `part`'s (none when `part` has none)."""
    base = cpu_us.get(part)
    if not base:
        return {}
    return {other: round(us / base, 3) for other, us in cpu_us.items() if other != part}


def client_restart_env(choice: str, environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to restart this process in so that its client runs `--client-grpc`
    `choice`, or None when it does already: gRPC core reads its setting once, when it
    starts, and it started when this module imported the client. "mesh" sets what every
    mesh process sets (`foundation.grpc_core`); a value in the environment already, even an
    empty one, is left as it is (as the mesh's processes leave it)."""
    if choice != "mesh" or EXPERIMENTS_ENV in environ:
        return None
    env = dict(environ)
    apply_defaults(env)
    return env


def micro_batches(asked: int, stages: int) -> int:
    """serve's --micro-batches for a mesh of `stages`: -1 one per stage, else `asked` (0:
    serve's default) but never more than the stages."""
    return stages if asked < 0 else min(asked, stages)


def floor(model: str, seqs: int, micro_batches: int, interval: int, steps_per_s: float,
          window_s: float = 6.0) -> dict[str, Any]:
    """The 2-stage floor run right after a W6 run: its steps/s, CPU a step by part, and
    the W6 run's share of it."""
    hidden = ModelConfig.from_dir(resolve_model(model)).hidden_size
    with tempfile.TemporaryDirectory(prefix="stagemesh-w6-floor-") as run_dir:
        got = measure_floor(seqs, micro_batches, hidden, interval, window=6, per_message=4,
                            window_s=window_s, run_dir=Path(run_dir), hops="unix")
    return {"floor_steps_per_s": got["steps_per_s"],
            "floor_cpu_us_per_step_by_part": got["cpu_us_per_step_by_part"],
            "vs_floor": steps_per_s / got["steps_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--model", default="default",
                    help="the model whose config the null stages take (no weights are read)")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="router's tokens per streamed update")
    ap.add_argument("--micro-batches", type=int, default=-1,
                    help="serve's --micro-batches (default -1: one per stage; 0: serve's own "
                         "default, one between stages that share this machine's cores)")
    ap.add_argument("--extra", default="", help="more `stagemesh serve` flags")
    ap.add_argument("--probes", type=int, default=0,
                    help="after the window, this many one-token requests into the steady "
                         "decode, one at a time: their times to first token (a mesh whose "
                         "running sequences are at --max-num-seqs per micro-batch queues them "
                         "until one ends, so at 1 stage they are not sent)")
    ap.add_argument("--no-metrics", action="store_true",
                    help="serve without the router's and stages' Prometheus endpoints")
    ap.add_argument("--client-grpc", choices=("default", "mesh"), default="default",
                    help="gRPC core's setting in this process, the client: gRPC's own "
                         "defaults (as W6 has run since it was defined), or the one every mesh "
                         "process runs (`foundation.grpc_core`; this process restarts with it)")
    ap.add_argument("--floor", action="store_true",
                    help="after each 2-stage run, its floor (`benchmarks.w6_floor`: the "
                         "mesh's processes passing the same messages with no logic, hops "
                         "over unix) at the same sequences, micro-batches and interval: "
                         "`floor_steps_per_s` and `vs_floor` beside steps/s, which the VM's "
                         "speed moves far less than steps/s alone")
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/w6-{dt.date.today()}.json"))
    args = ap.parse_args()
    if (env := client_restart_env(args.client_grpc, os.environ)) is not None:
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.control_plane",
                                   *sys.argv[1:]], env)
    config: dict[str, Any] = {"workload": "W6", "model": f"{args.model} (config only)",
                              "compute": "null model (no model work)",
                              "seqs": args.seqs, "tp": 1, "stream_interval": args.stream_interval,
                              "metrics": not args.no_metrics, "extra": args.extra,
                              "micro_batches": args.micro_batches,
                              "client_grpc": args.client_grpc, "floor": args.floor,
                              "client_grpc_experiments": os.environ.get(EXPERIMENTS_ENV),
                              "revision": git_revision(),
                              "python_ns_per_op_before": round(python_ns_per_op(), 1)}
    print(config)
    rows = []
    for p in (int(x) for x in args.stages.split(",")):
        mb = micro_batches(args.micro_batches, p)
        with Mesh("--model", args.model, "--stages", str(p), "--model-impl", "null",
                  "--max-num-seqs", str(args.seqs), "--num-blocks", str(NUM_BLOCKS),
                  "--stream-interval", str(args.stream_interval),
                  "--micro-batches", str(mb),
                  *(["--no-metrics"] if args.no_metrics else []), *args.extra.split()) as mesh:
            cpu = functools.partial(process_cpu, mesh.proc.proc.pid)
            woken = functools.partial(process_wakeups, mesh.proc.proc.pid)
            preempted = functools.partial(process_preemptions, mesh.proc.proc.pid)
            probes = args.probes if mb > 1 else 0
            result = asyncio.run(measure(mesh.address, args.seqs, args.window, cpu, woken,
                                         probes, preempted))
        rows.append({"stages": p, "micro_batches": mb, **result})
        if args.floor and p == 2:
            rows[-1].update(floor(args.model, args.seqs, mb, args.stream_interval,
                                  result["steps_per_s"]))
        print(rows[-1], flush=True)
    config["python_ns_per_op_after"] = round(python_ns_per_op(), 1)
    base = rows[0]["steps_per_s"]
    for r in rows:
        r["vs_first"] = r["steps_per_s"] / base
    write_json(args.out, config, rows)
    print_table([{k: v for k, v in r.items() if not k.endswith("_by_part")} for r in rows])
    for r in rows:
        print(f"{r['stages']} stage(s), CPU µs per step:", r["cpu_us_per_step_by_part"])
        print(f"{r['stages']} stage(s), CPU per step over the engine core's:",
              r["cpu_vs_engine_core_by_part"])
        print(f"{r['stages']} stage(s), wake-ups per step:", r["wakeups_per_step_by_part"])
        print(f"{r['stages']} stage(s), preemptions per step:",
              r["preemptions_per_step_by_part"])
    print("this machine's Python speed, ns per op of `report.python_ns_per_op` (before / "
          f"after): {config['python_ns_per_op_before']} / {config['python_ns_per_op_after']}")


if __name__ == "__main__":
    main()
