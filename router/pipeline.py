"""The router's side of the pipeline: one control channel and one Run stream per stage.

`Pipeline.start()` describes every stage, checks they form one pipeline, links the data
plane (each stage i > 0 listens, stage i-1 connects to it, with a fresh token per link) and
opens the Run streams. Plans go down every stream; results come up, the last stage's with
sampled tokens. Any broken stream, stage error or step past its timeout marks the pipeline
down; `Pipeline.relink()` brings it back with a new epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum

import grpc

from protos.stagemesh.stage.v1 import stage_pb2 as pb
from protos.stagemesh.stage.v1 import stage_pb2_grpc

log = logging.getLogger("stagemesh.router")

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20),
                   ("grpc.keepalive_time_ms", 10_000),
                   ("grpc.keepalive_timeout_ms", 5_000)]


class PipelineState(Enum):
    STARTING = "starting"
    READY = "ready"
    DOWN = "down"


class PipelineError(RuntimeError):
    """The stages do not form a usable pipeline, or one failed."""


@dataclass(frozen=True)
class PipelineShape:
    """What the stages reported at connect; capacity is the minimum over stages."""

    num_stages: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    tp_size: int
    dtype: str
    layer_ranges: tuple[tuple[int, int], ...]


ResultHandler = Callable[[pb.StepResult], None]
FailureHandler = Callable[[str], None]


class StageClient:
    """The control channel to one stage."""

    def __init__(self, index: int, address: str,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.index = index
        self.address = address
        self.channel = (grpc.aio.secure_channel(address, credentials, CHANNEL_OPTIONS)
                        if credentials is not None
                        else grpc.aio.insecure_channel(address, CHANNEL_OPTIONS))
        self.stub = stage_pb2_grpc.StageServiceStub(self.channel)
        self.run_call: grpc.aio.StreamStreamCall | None = None
        self.last_result: pb.StepResult | None = None

    async def describe(self, timeout_s: float) -> pb.DescribeResponse:
        """The stage's identity; an unreachable stage raises PipelineError naming it."""
        try:
            return await self.stub.Describe(pb.DescribeRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise PipelineError(f"stage {self.index} at {self.address}: "
                                f"{_describe_error(e)}") from e

    async def close(self) -> None:
        if self.run_call is not None:
            self.run_call.cancel()
        await self.channel.close()


class Pipeline:
    """Drives the stages' Run streams. Single event loop; not thread-safe."""

    def __init__(self, addresses: list[str], on_result: ResultHandler,
                 on_failure: FailureHandler, connect_timeout_s: float = 10.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        if not addresses:
            raise PipelineError("a pipeline needs at least one stage address")
        self.stages = [StageClient(i, a, credentials) for i, a in enumerate(addresses)]
        self.on_result = on_result
        self.on_failure = on_failure
        self.connect_timeout_s = connect_timeout_s
        self.state = PipelineState.STARTING
        self.shape: PipelineShape | None = None
        self.epoch = 0
        self._readers: list[asyncio.Task[None]] = []

    async def start(self, budget_s: float) -> PipelineShape:
        """Describe, validate, link and open streams, retrying until `budget_s` runs out.

        Raises PipelineError naming the stage that never answered or does not fit.
        """
        deadline = time.monotonic() + budget_s
        next_log = 0.0
        while True:
            try:
                return await self._start_once()
            except (grpc.aio.AioRpcError, PipelineError) as e:
                if time.monotonic() >= deadline:
                    raise PipelineError(f"pipeline did not come up within {budget_s:.0f}s: "
                                        f"{_describe_error(e)}") from e
                if time.monotonic() >= next_log:  # progress, not a line per retry
                    log.info("waiting for stages (%s); %.0fs left", _describe_error(e),
                             deadline - time.monotonic())
                    next_log = time.monotonic() + 10.0
                await asyncio.sleep(0.5)

    async def _start_once(self) -> PipelineShape:
        await self._close_streams()
        infos = await asyncio.gather(*(s.describe(self.connect_timeout_s) for s in self.stages))
        self.shape = _check_shape(infos)
        self.epoch += 1
        await self._link()
        for stage in self.stages:
            stage.run_call = stage.stub.Run()
        self._readers = [asyncio.create_task(self._read(s, self.epoch)) for s in self.stages]
        self.state = PipelineState.READY
        log.info("pipeline ready (epoch %d): %d stage(s), %d KV blocks of %d tokens",
                 self.epoch, self.shape.num_stages, self.shape.num_kv_blocks,
                 self.shape.block_size)
        return self.shape

    async def _link(self) -> None:
        """Stage i+1 listens, stage i connects: a fresh token per link, per epoch."""
        for up, down in zip(self.stages, self.stages[1:], strict=False):
            token = secrets.token_bytes(32)
            host = down.address.rpartition(":")[0] or "127.0.0.1"
            reply = await down.stub.Connect(pb.ConnectRequest(
                role=pb.LINK_ROLE_LISTEN_UPSTREAM, transport=pb.TRANSPORT_TCP, address=host,
                link_token=token, epoch=self.epoch), timeout=self.connect_timeout_s)
            await up.stub.Connect(pb.ConnectRequest(
                role=pb.LINK_ROLE_CONNECT_DOWNSTREAM, transport=pb.TRANSPORT_TCP,
                address=reply.address, link_token=token, epoch=self.epoch),
                timeout=self.connect_timeout_s)

    async def send(self, plan: pb.StepPlan) -> None:
        """Write one plan to every stage's stream (in pipeline order)."""
        if self.state is not PipelineState.READY:
            raise PipelineError("pipeline is not ready")
        writes: list[Awaitable[None]] = []
        for stage in self.stages:
            assert stage.run_call is not None
            writes.append(stage.run_call.write(plan))
        try:
            await asyncio.gather(*writes)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            self.mark_down(f"sending step {plan.step_id}: {_describe_error(e)}")

    async def _read(self, stage: StageClient, epoch: int) -> None:
        assert stage.run_call is not None
        call = stage.run_call
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    raise PipelineError(f"stage {stage.index} closed its Run stream")
                assert isinstance(msg, pb.StepResult)
                if msg.error:
                    raise PipelineError(msg.error)
                stage.last_result = msg
                if stage.index == len(self.stages) - 1:
                    self.on_result(msg)
        except asyncio.CancelledError:
            raise
        except (grpc.aio.AioRpcError, PipelineError) as e:
            if epoch == self.epoch and self.state is PipelineState.READY:
                self.mark_down(f"stage {stage.index} ({stage.address}): {_describe_error(e)}")

    def mark_down(self, reason: str) -> None:
        if self.state is PipelineState.DOWN:
            return
        log.error("pipeline down: %s", reason)
        self.state = PipelineState.DOWN
        self.on_failure(reason)

    async def _close_streams(self) -> None:
        for task in self._readers:
            task.cancel()
        for stage in self.stages:
            if stage.run_call is not None:
                stage.run_call.cancel()
                stage.run_call = None
        self._readers = []

    async def stage_stats(self, timeout_s: float = 2.0) -> list[pb.DescribeResponse | None]:
        """Live Describe of every stage (None for a stage that does not answer)."""
        async def one(stage: StageClient) -> pb.DescribeResponse | None:
            try:
                return await stage.describe(timeout_s)
            except grpc.aio.AioRpcError:
                return None
        return list(await asyncio.gather(*(one(s) for s in self.stages)))

    async def close(self, drain: bool = True) -> None:
        self.state = PipelineState.DOWN
        await self._close_streams()
        for stage in self.stages:
            if drain:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stage.stub.Drain(pb.DrainRequest(), timeout=2.0)
            await stage.close()


def _check_shape(infos: list[pb.DescribeResponse]) -> PipelineShape:
    """The stages must be 0..P-1 of one P-stage pipeline with contiguous layer ranges."""
    p = len(infos)
    for i, info in enumerate(infos):
        if info.stage_index != i or info.num_stages != p:
            raise PipelineError(f"stage at position {i} reports itself as stage "
                                f"{info.stage_index} of {info.num_stages}, expected {i} of {p}")
        if i and info.layer_start != infos[i - 1].layer_end:
            raise PipelineError(f"stage {i} starts at layer {info.layer_start}, but stage "
                                f"{i - 1} ends at {infos[i - 1].layer_end}")
        if info.block_size != infos[0].block_size:
            raise PipelineError(f"stage {i} has block size {info.block_size}, stage 0 has "
                                f"{infos[0].block_size}")
    return PipelineShape(p, min(i.num_kv_blocks for i in infos), infos[0].block_size,
                         infos[0].vocab_size, infos[0].tp_size, infos[0].dtype,
                         tuple((i.layer_start, i.layer_end) for i in infos))


def _describe_error(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e)
