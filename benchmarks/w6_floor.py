"""W6's floor: the mesh's five processes passing a W6 step's messages, and nothing else.

A skeleton of the mesh with every piece of logic taken out, built on the same stack
(uvloop, grpc.aio, blocking sockets on a step thread): whatever it costs a step, any mesh of
this shape pays before it schedules, converts, checks, samples or detokenizes anything.

- two stage processes, each a `StageService.Run` server whose reader hands each plan to a
  step thread (a stage's design: the thread owns the device) and whose step thread hands
  each finished step back to the event loop, one wake-up for all that are ready;
  - stage 0's step waits for the tokens of step k - micro_batches from its feedback thread
    (run-ahead), then sends the step's activations ([rows, hidden] fp32) to stage 1 over TCP;
  - stage 1's step receives them, sends the step's sampled ids back to stage 0 over TCP,
    and its loop answers each step with a `StepResult` of the ids (the ones ready together
    in one message);
- the engine core, which keeps `--window` steps in flight on both stages' Run streams
  (plans sent `--plans-per-message` at a time: the mesh averages about 4) and writes one
  message per answered step to the front over a Unix-domain stream;
- the front, which counts each sequence's tokens and, every `--stream-interval` of them,
  has that sequence's `Generate` handler write a response (a handler that lags merges what
  queued meanwhile, as the front does);
- this process as the clients: `--seqs` Generate streams, read as fast as they come.

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
import struct
import tempfile
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from benchmarks.report import cpu_seconds, git_revision, print_table, python_ns_per_op, write_json
from protos.stagemesh.stage.v1 import stage_pb2 as stage_pb
from protos.stagemesh.stage.v1 import stage_pb2_grpc as stage_grpc
from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc as pb_grpc

_HEADER = struct.Struct("<qq")  # step id, payload bytes: a data-plane message's framing
_LENGTH = struct.Struct("<I")  # the core -> front stream's framing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


class _StageSkeleton(stage_grpc.StageServiceServicer):
    """A stage with no work: a step moves the step's bytes on the data plane, nothing else.

    `last`: receive activations, send feedback, answer every step; else wait for feedback,
    send activations, answer nothing."""

    def __init__(self, last: bool, data: socket.socket, feedback: socket.socket,
                 rows: int, hidden: int, lag: int) -> None:
        self.last, self.data, self.feedback, self.lag = last, data, feedback, lag
        self.activations = bytes(rows * hidden * 4)
        self.inbox = memoryview(bytearray(len(self.activations)))
        self.ids = bytes(8 * 2 * rows)  # a step's sampled (seq id, token id) pairs
        self.packed = bytes(8 * rows)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-step")
        self.fed: dict[int, bytes] = {}
        self.fed_cv = threading.Condition()
        if not last:
            threading.Thread(target=self._read_feedback, daemon=True).start()

    def _read_feedback(self) -> None:
        """Stage 0's feedback thread: each step's ids into `fed`, waking the step thread."""
        header = memoryview(bytearray(_HEADER.size))
        while True:
            _recv_exact(self.feedback, header)
            step_id, size = _HEADER.unpack(header)
            body = memoryview(bytearray(size))
            _recv_exact(self.feedback, body)
            with self.fed_cv:
                self.fed[step_id] = bytes(body)
                self.fed_cv.notify()

    def _step(self, step_id: int) -> None:
        """Step thread."""
        if self.last:
            header = memoryview(bytearray(_HEADER.size))
            _recv_exact(self.data, header)
            got_step, size = _HEADER.unpack(header)
            assert got_step == step_id and size == len(self.inbox), (got_step, size)
            _recv_exact(self.data, self.inbox)
            self.feedback.sendmsg([_HEADER.pack(step_id, len(self.ids)), self.ids])
        else:
            if step_id >= self.lag:
                with self.fed_cv:
                    while step_id - self.lag not in self.fed:
                        self.fed_cv.wait()
                    del self.fed[step_id - self.lag]
            self.data.sendmsg([_HEADER.pack(step_id, len(self.activations)), self.activations])

    async def Run(self, request_iterator: AsyncIterator[stage_pb.StepPlans],
                  context: grpc.aio.ServicerContext) -> AsyncIterator[stage_pb.StepResults]:
        loop = asyncio.get_running_loop()
        ready: deque[int] = deque()
        done: asyncio.Queue[int] = asyncio.Queue()
        scheduled = False

        def drain() -> None:  # loop thread
            nonlocal scheduled
            scheduled = False
            while ready:
                done.put_nowait(ready.popleft())

        def step(step_id: int) -> None:  # step thread
            nonlocal scheduled
            self._step(step_id)
            ready.append(step_id)
            if not scheduled:
                scheduled = True
                loop.call_soon_threadsafe(drain)

        async def read_plans() -> None:
            async for plans in request_iterator:
                for plan in plans.plans:
                    self.worker.submit(step, plan.step_id)

        reader = asyncio.create_task(read_plans())
        try:
            while True:
                steps = [await done.get()]
                while not done.empty():
                    steps.append(done.get_nowait())
                if self.last:
                    yield stage_pb.StepResults(results=[
                        stage_pb.StepResult(step_id=s, kv_blocks_used=1, num_sequences=1,
                                            sampled_seq_ids=self.packed,
                                            sampled_token_ids=self.packed) for s in steps])
        finally:
            reader.cancel()


def _stage_main(index: int, port: int, data_port: int, feedback_port: int, rows: int,
                hidden: int, lag: int, listening: Any, ready: Any) -> None:
    import uvloop

    # Stage 1 listens for activations, stage 0 for feedback; each connects to the other.
    if index == 1:
        listener = socket.create_server(("127.0.0.1", data_port))
        listening.set()  # stage 0 may connect its activations
        data, _ = listener.accept()
        feedback = socket.create_connection(("127.0.0.1", feedback_port))
    else:
        listener = socket.create_server(("127.0.0.1", feedback_port))
        data = socket.create_connection(("127.0.0.1", data_port))
        feedback, _ = listener.accept()
    for s in (data, feedback):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def main() -> None:
        server = grpc.aio.server()
        stage_grpc.add_StageServiceServicer_to_server(
            _StageSkeleton(index == 1, data, feedback, rows, hidden, lag), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    uvloop.install()
    asyncio.run(main())


def _plan_batch(rows: int) -> stage_pb.CachedBatch:
    """A steady decode step's diffs for `rows` sequences: every one run-ahead, one new
    block per 16 tokens (what the mesh's plans carry, as packed columns)."""
    new_blocks = max(1, rows // 16)
    return stage_pb.CachedBatch(
        seq_ids=bytes(8 * rows), num_computed=bytes(4 * rows), num_new=bytes(4 * rows),
        flags=bytes([3]) * rows, input_from_step=bytes(8 * rows),
        new_block_counts=bytes(4 * rows), new_block_ids=bytes(4 * new_blocks),
        append_token_counts=bytes(4 * rows))


def _core_main(ports: tuple[int, int], uds_path: str, window: int, per_message: int,
               rows: int, steps: Any, ready: Any) -> None:
    import uvloop

    async def main() -> None:
        fronts: list[asyncio.Transport] = []
        connected = asyncio.Event()

        class _Accept(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                fronts.append(transport)  # type: ignore[arg-type]
                connected.set()

        server = await asyncio.get_running_loop().create_unix_server(_Accept, uds_path)
        ready.set()
        await connected.wait()
        front = fronts[0]
        batch = _plan_batch(rows)
        outputs = bytes(16 * rows + 64)  # a step's StepOutputs for the front, about
        framed = _LENGTH.pack(len(outputs)) + outputs
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
        runs = [stage_grpc.StageServiceStub(c).Run(wait_for_ready=True) for c in channels]
        inflight, next_step = 0, 0
        room = asyncio.Event()

        async def send() -> None:
            nonlocal inflight, next_step
            while True:
                while window - inflight < per_message:
                    await room.wait()
                    room.clear()
                n = window - inflight
                msg = stage_pb.StepPlans(plans=[
                    stage_pb.StepPlan(step_id=next_step + i, cached_batch=batch)
                    for i in range(n)])
                next_step += n
                inflight += n
                await asyncio.gather(*(run.write(msg) for run in runs))

        async def read() -> None:
            nonlocal inflight
            while True:
                msg = await runs[1].read()
                for _ in msg.results:
                    inflight -= 1
                    steps.value += 1
                    front.write(framed)
                room.set()

        await asyncio.gather(send(), read())
        server.close()

    uvloop.install()
    asyncio.run(main())


class _FrontSkeleton(pb_grpc.InferenceServiceServicer):
    """Generate streams fed by the core's per-step messages: a sequence's handler writes a
    response each time `interval` of its tokens arrived (merging what queued meanwhile)."""

    def __init__(self, seqs: int, rows: int, interval: int) -> None:
        self.rows, self.interval, self.seqs = rows, interval, seqs
        self.queues: list[asyncio.Queue[int]] = [asyncio.Queue() for _ in range(seqs)]
        self.counts = [0] * seqs
        self.step = 0

    def on_step(self) -> None:
        """One step's outputs: its micro-batch's sequences got a token each."""
        first = (self.step * self.rows) % self.seqs
        self.step += 1
        for i in range(first, first + self.rows):
            self.counts[i] += 1
            if self.counts[i] == self.interval:
                self.counts[i] = 0
                self.queues[i].put_nowait(self.interval)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        queue = self.queues[int(request.request_id)]
        while True:
            n = await queue.get()
            while not queue.empty():
                n += queue.get_nowait()
            yield pb.GenerateResponse(request_id=request.request_id, index=0, text=" t" * n,
                                      token_ids=[1000] * n)


def _front_main(port: int, uds_path: str, seqs: int, rows: int, interval: int,
                ready: Any) -> None:
    import uvloop

    async def main() -> None:
        front = _FrontSkeleton(seqs, rows, interval)

        class _Read(asyncio.Protocol):
            def __init__(self) -> None:
                self.buffer = bytearray()

            def data_received(self, data: bytes) -> None:
                buf = self.buffer
                buf += data
                while len(buf) >= _LENGTH.size:
                    (size,) = _LENGTH.unpack_from(buf)
                    if len(buf) < _LENGTH.size + size:
                        break
                    del buf[: _LENGTH.size + size]
                    front.on_step()

        server = grpc.aio.server()
        pb_grpc.add_InferenceServiceServicer_to_server(front, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await asyncio.get_running_loop().create_unix_connection(_Read, uds_path)
        ready.set()
        await server.wait_for_termination()

    uvloop.install()
    asyncio.run(main())


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
            per_message: int, window_s: float, run_dir: Path) -> dict[str, Any]:
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
        procs["stage 1"] = ctx.Process(target=_stage_main, args=(
            1, stage_ports[1], data_port, feedback_port, rows, hidden, micro_batches,
            listening, ready[1]))
        procs["stage 1"].start()
        listening.wait(30)
        procs["stage 0"] = ctx.Process(target=_stage_main, args=(
            0, stage_ports[0], data_port, feedback_port, rows, hidden, micro_batches,
            listening, ready[0]))
        procs["stage 0"].start()
        if not all(r.wait(30) for r in ready):
            raise RuntimeError("the skeleton stages did not come up in 30 s")
        ready_core, ready_front = ctx.Event(), ctx.Event()
        procs["engine core"] = ctx.Process(target=_core_main, args=(
            tuple(stage_ports), uds_path, window, per_message, rows, steps, ready_core))
        procs["engine core"].start()
        ready_core.wait(30)
        procs["front"] = ctx.Process(target=_front_main, args=(
            front_port, uds_path, seqs, rows, interval, ready_front))
        procs["front"].start()
        if not ready_front.wait(30):
            raise RuntimeError("the skeleton mesh did not come up in 30 s")
        pids = {role: p.pid for role, p in procs.items()}
        return asyncio.run(_clients(front_port, seqs, steps, pids, window_s))
    finally:
        for p in procs.values():
            p.kill()
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
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/w6-floor-{dt.date.today()}.json"))
    args = ap.parse_args()
    config: dict[str, Any] = {
        "benchmark": "W6 floor: the mesh's processes and messages, no logic",
        "grpc": grpc.__version__, "cpus": os.cpu_count(), "seqs": args.seqs,
        "micro_batches": args.micro_batches, "hidden": args.hidden, "window": args.window,
        "plans_per_message": args.plans_per_message, "revision": git_revision(),
        "python_ns_per_op_before": round(python_ns_per_op(), 1)}
    print(config, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="stagemesh-w6-floor-") as run_dir:
        for interval in (int(x) for x in args.stream_interval.split(",")):
            got = measure(args.seqs, args.micro_batches, args.hidden, interval, args.window,
                          args.plans_per_message, args.window_s, Path(run_dir))
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
