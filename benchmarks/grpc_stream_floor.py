"""The floor that gRPC's Python asyncio stack puts under the mesh's streams.

Two bare servers, each its own process (uvloop, grpc.aio, as the router's front and the
stages), against clients in this process (grpc.aio, as `router.client.RouterClient` and the
engine core); nothing else runs, no model, no scheduler, no detokenization:

- `generate`: `InferenceService.Generate` streams one-token `GenerateResponse`s as fast as
  it can to `--streams` concurrent clients (W6 at stream interval 1 sends one per token);
- `run`: `StageService.Run` answers each `StepPlans` with a `StepResults` of 32 sampled
  tokens, the client keeping `--depth` plans in flight on one stream (the core and a last
  stage, one message each way per step).

Messages per second over `--window` seconds and each side's CPU per message: what any
server built on grpc.aio pays per streamed message on this machine.

    python -m benchmarks.grpc_stream_floor --streams 1,64 --out floor.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import multiprocessing as mp
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from benchmarks.bare_grpc import serve
from benchmarks.report import cpu_seconds, git_revision, write_json
from protos.stagemesh.stage.v1 import stage_pb2 as stage_pb
from protos.stagemesh.stage.v1 import stage_pb2_grpc as stage_grpc
from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc as pb_grpc

_PACKED_32 = bytes(8 * 32)  # 32 packed int64: a step's sampled ids or tokens


class _Streamer(pb_grpc.InferenceServiceServicer):
    """Generate: `max_tokens` one-token responses, written back to back."""

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        for i in range(request.max_tokens):
            yield pb.GenerateResponse(request_id=request.request_id, index=0, text=" tok",
                                      token_ids=[1000 + i % 1000])


class _Stage(stage_grpc.StageServiceServicer):
    """Run: one StepResults per StepPlans, as a last stage answers."""

    async def Run(self, request_iterator: AsyncIterator[stage_pb.StepPlans],
                  context: grpc.aio.ServicerContext) -> AsyncIterator[stage_pb.StepResults]:
        async for plans in request_iterator:
            yield stage_pb.StepResults(results=[
                stage_pb.StepResult(step_id=p.step_id, sampled_seq_ids=_PACKED_32,
                                    sampled_token_ids=_PACKED_32) for p in plans.plans])


def _register(server: grpc.aio.Server) -> None:
    pb_grpc.add_InferenceServiceServicer_to_server(_Streamer(), server)
    stage_grpc.add_StageServiceServicer_to_server(_Stage(), server)


def _serve(port: int, ready: Any) -> None:
    serve(_register, port, ready)


async def _window(count: Callable[[], int], server_pid: int, window_s: float
                  ) -> tuple[int, float, float, float]:
    """After a second for the load to settle: over `window_s`, how far `count()` moved, the
    seconds, and the server's and this process's CPU seconds."""
    await asyncio.sleep(1.0)
    n0, t0 = count(), time.perf_counter()
    s0, c0 = cpu_seconds(server_pid), time.process_time()
    await asyncio.sleep(window_s)
    n1, t1 = count(), time.perf_counter()
    s1, c1 = cpu_seconds(server_pid), time.process_time()
    return n1 - n0, t1 - t0, s1 - s0, c1 - c0


async def _measure(port: int, server_pid: int, streams: int, window_s: float
                   ) -> dict[str, float]:
    received = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)

        async def one(i: int) -> None:
            nonlocal received
            while True:  # each stream long enough to outlast the window, then again
                request = pb.GenerateRequest(request_id=f"r{i}", max_tokens=100_000)
                async for _ in stub.Generate(request):
                    received += 1

        tasks = [asyncio.create_task(one(i)) for i in range(streams)]
        try:
            count, seconds, server_s, client_s = await _window(lambda: received, server_pid,
                                                               window_s)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {"messages_per_s": count / seconds,
            "server_cpu_us_per_message": server_s * 1e6 / count,
            "client_cpu_us_per_message": client_s * 1e6 / count}


async def _measure_run(port: int, server_pid: int, depth: int, window_s: float
                       ) -> dict[str, float]:
    """One Run stream, `depth` plans in flight: a plan goes out as each result comes back."""
    answered = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = stage_grpc.StageServiceStub(channel).Run()
        step = 0

        async def reader() -> None:
            nonlocal answered, step
            async for results in call:
                answered += len(results.results)
                step += 1
                await call.write(stage_pb.StepPlans(plans=[stage_pb.StepPlan(step_id=step)]))

        for step in range(depth):
            await call.write(stage_pb.StepPlans(plans=[stage_pb.StepPlan(step_id=step)]))
        task = asyncio.create_task(reader())
        try:
            steps, seconds, server_s, client_s = await _window(lambda: answered, server_pid,
                                                               window_s)
        finally:
            call.cancel()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return {"steps_per_s": steps / seconds,  # one message each way per step
            "server_cpu_us_per_step": server_s * 1e6 / steps,
            "client_cpu_us_per_step": client_s * 1e6 / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--streams", default="64", help="comma-separated stream counts")
    ap.add_argument("--depths", default="1,2,4",
                    help="comma-separated plans in flight on the Run stream")
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("--port", type=int, default=50197)
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/grpc-stream-floor-{dt.date.today()}.json"))
    args = ap.parse_args()
    config = {"benchmark": "grpc.aio streaming floor", "grpc": grpc.__version__,
              "cpus": os.cpu_count(), "message": "GenerateResponse, one token",
              "revision": git_revision()}
    print(config, flush=True)
    ready = mp.Event()
    server = mp.Process(target=_serve, args=(args.port, ready), daemon=True)
    server.start()
    if not ready.wait(30):
        raise SystemExit("the streaming server did not start within 30 s")
    import uvloop
    uvloop.install()
    rows = []
    try:
        for streams in (int(s) for s in args.streams.split(",")):
            assert server.pid is not None
            got = asyncio.run(_measure(args.port, server.pid, streams, args.window))
            rows.append({"case": f"generate, {streams} streams", **got})
            print(rows[-1], flush=True)
        for depth in (int(d) for d in args.depths.split(",")):
            assert server.pid is not None
            got = asyncio.run(_measure_run(args.port, server.pid, depth, args.window))
            rows.append({"case": f"run, {depth} in flight", **got})
            print(rows[-1], flush=True)
    finally:
        server.terminate()
        server.join(10)
    write_json(args.out, config, rows)
    for r in rows:
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()})


if __name__ == "__main__":
    main()
