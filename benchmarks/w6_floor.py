"""W6's floor: the mesh's five processes passing a W6 step's messages, and nothing else.

A skeleton of the mesh with every piece of logic taken out (`benchmarks.w6_skeleton`: two
stages with a step thread each and stage 0's feedback thread, an engine core, a front),
built on the same stack (uvloop, grpc.aio, blocking sockets on a step thread), and this
process as the clients: `--seqs` Generate streams, read as fast as they come. Whatever it
costs a step, any mesh of this shape pays before it schedules, converts, checks, samples or
detokenizes anything. The messages are W6's: plans `--plans-per-message` at a time with
`--window` steps in flight (the defaults, 4 and 6, were the mesh's when the floor was first
measured; W6 now runs about 9 plans a message with up to 16 steps out, a shape that
`--window 12 --plans-per-message 8` comes near), one answer a step, the activation
hop ([rows, hidden] fp32) and the sampled ids' hop on a Unix-domain socket, as the mesh's
stages of one host link them (`--hops tcp`: loopback TCP, the floor's shape until
2026-12-07), one core -> front message a step, and a client response every
`--stream-interval` tokens of a sequence. (The mesh's stage 0 now reads the sampled ids on
its step thread, with no feedback thread; the skeleton keeps that thread, the shape its
floor was measured with: docs/BENCHMARKS.md, W6.) `--plans forwarded` prices a design the
mesh does not run: stage 1's plans carried by stage 0 with the activations, not sent by the
core (`w6_skeleton.core_main`).

Steps per second and each process's CPU per step over `--window-s` seconds, beside the
machine's Python speed (`report.python_ns_per_op`). Against W6 (`benchmarks.control_plane`)
in the same hour: the part of a W6 step no code of ours can remove without changing the
mesh's shape (its processes, threads and messages).

    python -m benchmarks.w6_floor --out benchmarks/results/w6-floor.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import multiprocessing as mp
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.report import cpu_seconds, git_revision, print_table, python_ns_per_op, write_json
from benchmarks.w6_skeleton import core_main, front_main, stage_main
from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc as pb_grpc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])



async def _clients(port: int, seqs: int, steps: Any, pids: dict[str, int],
                   window_s: float) -> dict[str, Any]:
    tokens = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)

        async def one(i: int) -> None:
            nonlocal tokens
            async for msg in stub.Generate(pb.GenerateRequest(request_id=str(i))):
                tokens += len(msg.token_ids)

        tasks = [asyncio.create_task(one(i)) for i in range(seqs)]
        try:
            await asyncio.sleep(2.0)  # every stream open, the pipeline full
            s0, k0, t0 = steps.value, tokens, time.perf_counter()
            c0 = {**{r: cpu_seconds(p) for r, p in pids.items()}, "client": time.process_time()}
            await asyncio.sleep(window_s)
            s1, k1, t1 = steps.value, tokens, time.perf_counter()
            c1 = {**{r: cpu_seconds(p) for r, p in pids.items()}, "client": time.process_time()}
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    n = max(s1 - s0, 1)
    cpu = {r: round((c1[r] - c0[r]) * 1e6 / n) for r in c1}
    return {"steps_per_s": n / (t1 - t0), "tokens_per_s": (k1 - k0) / (t1 - t0),
            "cpu_us_per_step": sum(cpu.values()), "cpu_us_per_step_by_part": cpu}


def measure(seqs: int, micro_batches: int, hidden: int, interval: int, window: int,
            per_message: int, window_s: float, run_dir: Path, hops: str = "unix",
            forwarded: bool = False) -> dict[str, Any]:
    """One skeleton mesh up, measured, and down."""
    ctx = mp.get_context("spawn")
    rows = seqs // micro_batches
    stage_ports, front_port = [_free_port(), _free_port()], _free_port()
    data_port, feedback_port = _free_port(), _free_port()
    uds_path = str(run_dir / "core.sock")
    steps = ctx.Value("q", 0, lock=False)
    procs: dict[str, Any] = {}
    try:
        listening, ready = ctx.Event(), [ctx.Event(), ctx.Event()]
        procs["stage 1"] = ctx.Process(target=stage_main, args=(
            1, stage_ports[1], data_port, feedback_port, rows, hidden, micro_batches,
            listening, ready[1], hops, forwarded))
        procs["stage 1"].start()
        listening.wait(30)
        procs["stage 0"] = ctx.Process(target=stage_main, args=(
            0, stage_ports[0], data_port, feedback_port, rows, hidden, micro_batches,
            listening, ready[0], hops, forwarded))
        procs["stage 0"].start()
        if not all(r.wait(30) for r in ready):
            raise RuntimeError("the skeleton stages did not come up in 30 s")
        ready_core, ready_front = ctx.Event(), ctx.Event()
        procs["engine core"] = ctx.Process(target=core_main, args=(
            tuple(stage_ports), uds_path, window, per_message, rows, steps, ready_core,
            forwarded))
        procs["engine core"].start()
        ready_core.wait(30)
        procs["front"] = ctx.Process(target=front_main, args=(
            front_port, uds_path, seqs, rows, interval, ready_front))
        procs["front"].start()
        if not ready_front.wait(30):
            raise RuntimeError("the skeleton mesh did not come up in 30 s")
        pids = {role: p.pid for role, p in procs.items()}
        return asyncio.run(_clients(front_port, seqs, steps, pids, window_s))
    finally:  # all killed before any is waited for, so none lives on to report the others
        for p in procs.values():
            p.kill()
        for p in procs.values():
            p.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--micro-batches", type=int, default=2,
                    help="micro-batches in flight (W6: one per stage)")
    ap.add_argument("--hidden", type=int, default=576,
                    help="activation width (fp32): the default model's")
    ap.add_argument("--stream-interval", default="16",
                    help="tokens per streamed update, comma-separated for several runs")
    ap.add_argument("--window", type=int, default=6, help="steps in flight (the core's)")
    ap.add_argument("--plans-per-message", type=int, default=4)
    ap.add_argument("--window-s", type=float, default=6.0)
    ap.add_argument("--hops", choices=("unix", "tcp"), default="unix",
                    help="the activation and feedback hops' sockets")
    ap.add_argument("--plans", choices=("each", "forwarded"), default="each",
                    help="each: the core sends every stage its plans (the mesh's shape); "
                    "forwarded: to stage 0 only, which forwards stage 1's with the "
                    "activations (a design priced, not run)")
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/w6-floor-{dt.date.today()}.json"))
    args = ap.parse_args()
    config: dict[str, Any] = {
        "benchmark": "W6 floor: the mesh's processes and messages, no logic",
        "grpc": grpc.__version__, "cpus": os.cpu_count(), "seqs": args.seqs,
        "micro_batches": args.micro_batches, "hidden": args.hidden, "window": args.window,
        "plans_per_message": args.plans_per_message, "hops": args.hops,
        "plans": args.plans,
        "revision": git_revision(),
        "python_ns_per_op_before": round(python_ns_per_op(), 1)}
    print(config, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="stagemesh-w6-floor-") as run_dir:
        for interval in (int(x) for x in args.stream_interval.split(",")):
            got = measure(args.seqs, args.micro_batches, args.hidden, interval, args.window,
                          args.plans_per_message, args.window_s, Path(run_dir), args.hops,
                          args.plans == "forwarded")
            rows.append({"stream_interval": interval, **got})
            print(rows[-1], flush=True)
    config["python_ns_per_op_after"] = round(python_ns_per_op(), 1)
    write_json(args.out, config, rows)
    print_table([{k: v for k, v in r.items() if k != "cpu_us_per_step_by_part"} for r in rows])
    for r in rows:
        print(f"interval {r['stream_interval']}, CPU µs per step:", r["cpu_us_per_step_by_part"])
    print("this machine's Python speed, ns per op (before / after): "
          f"{config['python_ns_per_op_before']} / {config['python_ns_per_op_after']}")


if __name__ == "__main__":
    main()
