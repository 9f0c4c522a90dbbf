"""The W6 floor's skeleton mesh: four processes with the mesh's shape and no logic
(`benchmarks.w6_floor` starts them and is the fifth, the clients).

- `stage_main`: a `StageService.Run` server whose reader hands each plan to a step thread
  (a stage's design: the thread owns the device) and whose step thread hands each finished
  step back to the event loop, one wake-up for all that are ready.
  - Stage 0's step waits for the tokens of step k - micro_batches from its feedback thread
    (run-ahead), then sends the step's activations ([rows, hidden] fp32) to stage 1 over
    TCP or, as the mesh's stages of one host link now, a Unix-domain socket (`hops`).
  - Stage 1's step receives them and sends the step's sampled ids back to stage 0 the
    same way. Its loop answers each step with a `StepResult` of the ids (the ones ready
    together in one message).
- `core_main`: the engine core, which keeps a window of steps in flight on both stages'
  Run streams and writes one message per answered step to the front over a Unix-domain
  stream.
- `front_main`: the front, which counts each sequence's tokens and, every stream interval
  of them, has that sequence's `Generate` handler write a response (a handler that lags
  merges what queued meanwhile, as the front does).

Each moves only bytes of the mesh's sizes with the mesh's stack (uvloop, grpc.aio,
blocking sockets on the step threads): no scheduling, conversion, checks, sampling or
detokenization. The framings are the skeleton's own (a 16-byte header on the data plane, a
4-byte length to the front), no heavier than the mesh's.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from benchmarks.bare_grpc import serve
from protos.stagemesh.stage.v1 import stage_pb2 as stage_pb
from protos.stagemesh.stage.v1 import stage_pb2_grpc as stage_grpc
from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc as pb_grpc
from stage_worker.dataplane.handshake import UNIX_SEND_BUFFER_BYTES

_HEADER = struct.Struct("<qq")  # step id, payload bytes: a data-plane message's framing
_FORWARDED = struct.Struct("<qqq")  # step id, activation bytes, the next stage's plan bytes
_LENGTH = struct.Struct("<I")  # the core -> front stream's framing


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
    send activations, answer nothing. `forwarded`: stage 1 gets each step's plan from stage
    0, ahead of the step's activations, not from the core (see `core_main`)."""

    def __init__(self, last: bool, data: socket.socket, feedback: socket.socket,
                 rows: int, hidden: int, lag: int, forwarded: bool = False) -> None:
        self.last, self.data, self.feedback, self.lag = last, data, feedback, lag
        self.forwarded = forwarded
        # What stage 0 forwards a step: the next stage's plan, as the core serialized it.
        self.plan_bytes = (stage_pb.StepPlan(step_id=1 << 40, cached_batch=_plan_batch(rows))
                           .SerializeToString() if forwarded and not last else b"")
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
            if self.forwarded:
                self.data.sendmsg([_FORWARDED.pack(step_id, len(self.activations),
                                                   len(self.plan_bytes)),
                                   self.plan_bytes, self.activations])
            else:
                self.data.sendmsg([_HEADER.pack(step_id, len(self.activations)),
                                   self.activations])

    def _forwarded_step(self) -> int:
        """Stage 1's step thread with forwarded plans: the next step's plan and
        activations from stage 0 (the plan parsed, as gRPC parsed it), its ids fed back."""
        header = memoryview(bytearray(_FORWARDED.size))
        _recv_exact(self.data, header)
        step_id, size, plan_size = _FORWARDED.unpack(header)
        plan = memoryview(bytearray(plan_size))
        _recv_exact(self.data, plan)
        stage_pb.StepPlan.FromString(plan)
        assert size == len(self.inbox), size
        _recv_exact(self.data, self.inbox)
        self.feedback.sendmsg([_HEADER.pack(step_id, len(self.ids)), self.ids])
        return int(step_id)

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

        def forwarded_steps() -> None:  # step thread, for the life of the stream
            nonlocal scheduled
            while True:
                ready.append(self._forwarded_step())
                if not scheduled:
                    scheduled = True
                    loop.call_soon_threadsafe(drain)

        async def read_plans() -> None:
            if self.last and self.forwarded:
                self.worker.submit(forwarded_steps)
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


def stage_main(index: int, port: int, data_port: int, feedback_port: int, rows: int,
               hidden: int, lag: int, listening: Any, ready: Any, hops: str,
               forwarded: bool = False) -> None:
    """Stage `index` (0 or 1) of the skeleton, serving `Run` on `port`; `listening` is set
    once stage 1 takes stage 0's activation link, `ready` once the stage serves. `hops`:
    "tcp" (loopback) or "unix" (an abstract name made from the port; the send buffer the
    mesh's `unix` transport asks for). `forwarded`: see `core_main`."""
    # Stage 1 listens for activations, stage 0 for feedback; each connects to the other.
    if index == 1:
        listener = _listen(hops, data_port)
        listening.set()  # stage 0 may connect its activations
        data, _ = listener.accept()
        feedback = _connect(hops, feedback_port)
    else:
        listener = _listen(hops, feedback_port)
        data = _connect(hops, data_port)
        feedback, _ = listener.accept()
    for s in (data, feedback):
        if hops == "unix":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SEND_BUFFER_BYTES)
        else:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stage = _StageSkeleton(index == 1, data, feedback, rows, hidden, lag, forwarded)
    serve(lambda server: stage_grpc.add_StageServiceServicer_to_server(stage, server), port,
          ready)


def _unix_name(port: int) -> str:
    """A hop's abstract name: the benchmark's pid (every skeleton process's parent) and the
    port, so runs side by side never meet."""
    return f"\0stagemesh-w6-floor-{os.getppid()}-{port}"


def _listen(hops: str, port: int) -> socket.socket:
    if hops == "tcp":
        return socket.create_server(("127.0.0.1", port))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(_unix_name(port))
    sock.listen(1)
    return sock


def _connect(hops: str, port: int) -> socket.socket:
    if hops == "tcp":
        return socket.create_connection(("127.0.0.1", port))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(_unix_name(port))
    return sock


def _plan_batch(rows: int) -> stage_pb.CachedBatch:
    """A steady decode step's diffs for `rows` sequences: every one run-ahead, one new
    block per 16 tokens (what the mesh's plans carry, as packed columns)."""
    new_blocks = max(1, rows // 16)
    return stage_pb.CachedBatch(
        seq_ids=bytes(8 * rows), num_computed=bytes(4 * rows), num_new=bytes(4 * rows),
        flags=bytes([3]) * rows, input_from_step=bytes(8 * rows),
        new_block_counts=bytes(4 * rows), new_block_ids=bytes(4 * new_blocks),
        append_token_counts=bytes(4 * rows))


def core_main(ports: tuple[int, int], uds_path: str, window: int, per_message: int,
              rows: int, steps: Any, ready: Any, forwarded: bool = False) -> None:
    """The skeleton's engine core: `window` steps in flight on both stages' `Run` streams,
    plans sent once `per_message` fit; one message to the front (listening at `uds_path`,
    `ready` set once it does) and one count in `steps` per answered step.

    `forwarded`: plans go to stage 0 only, which forwards each step's plan for stage 1 with
    the step's activations (a design the mesh does not run: this prices it). The core still
    serializes stage 1's plans, as it would to hand them to stage 0; stage 1's stream then
    carries only its answers."""
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
                if forwarded:
                    msg.SerializeToString()  # stage 1's plans, carried by stage 0's message
                    await runs[0].write(msg)
                else:
                    await asyncio.gather(*(run.write(msg) for run in runs))

        async def read() -> None:
            nonlocal inflight
            if forwarded:
                await runs[1].write(stage_pb.StepPlans())  # opens its stream: answers only
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


class _FromCore(asyncio.Protocol):
    """The front's end of the core's stream: one `on_step` per length-framed message."""

    def __init__(self, front: _FrontSkeleton) -> None:
        self.front = front
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        while len(buf) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buf)
            if len(buf) < _LENGTH.size + size:
                break
            del buf[: _LENGTH.size + size]
            self.front.on_step()


def front_main(port: int, uds_path: str, seqs: int, rows: int, interval: int,
               ready: Any) -> None:
    """The skeleton's front: `seqs` Generate streams on `port`, fed by the core's stream at
    `uds_path`; `ready` set once it serves and is connected to the core."""
    front = _FrontSkeleton(seqs, rows, interval)

    async def connect() -> object:
        return await asyncio.get_running_loop().create_unix_connection(
            lambda: _FromCore(front), uds_path)

    serve(lambda server: pb_grpc.add_InferenceServiceServicer_to_server(front, server), port,
          ready, connect)
