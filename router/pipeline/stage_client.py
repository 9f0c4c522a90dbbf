"""The control channel to one stage: Describe, Connect, the Run stream, Drain."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from foundation.grpc_auth import bearer_metadata
from protos.stagemesh.stage.v1 import stage_pb2 as pb
from protos.stagemesh.stage.v1 import stage_pb2_grpc
from router.pipeline.convert import (
    assign_request,
    connect_request,
    info_from_describe,
    listen_request,
    outcome_from_result,
)
from router.pipeline.outcome import StepOutcome
from router.pipeline.shape import PipelineError, PipelineShape, StageInfo

# A stage that is down (restarting, not started yet) is retried by `Pipeline.start` every
# START_RETRY_S; the channel's reconnect backoff is capped near that, else gRPC's default
# (1 s growing 1.6x up to 120 s) leaves a stage that is back unlinked for seconds to minutes.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20),
                   ("grpc.keepalive_time_ms", 10_000),
                   ("grpc.keepalive_timeout_ms", 5_000),
                   ("grpc.initial_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", 1_000)]


@dataclass(frozen=True, slots=True)
class StageAnswer:
    """One StepResult as the driver reads it: the outcome only from the last stage."""

    step_id: int
    error: str
    outcome: StepOutcome | None


class StageClient:
    """One stage's control channel. Single event loop; not thread-safe."""

    def __init__(self, index: int, address: str, is_last: bool,
                 credentials: grpc.ChannelCredentials | None = None,
                 stage_token: str = "") -> None:
        self.index = index
        self.metadata = bearer_metadata(stage_token)  # on every call: the pairing
        self.address = address
        self.is_last = is_last
        self.channel = (grpc.aio.secure_channel(address, credentials, CHANNEL_OPTIONS)
                        if credentials is not None
                        else grpc.aio.insecure_channel(address, CHANNEL_OPTIONS))
        self.stub = stage_pb2_grpc.StageServiceStub(self.channel)
        self._run: grpc.aio.StreamStreamCall | None = None

    async def describe(self, timeout_s: float) -> StageInfo:
        """The stage's identity and capacity; an unreachable stage raises PipelineError
        naming it."""
        try:
            return info_from_describe(await self.stub.Describe(
                pb.DescribeRequest(), timeout=timeout_s, metadata=self.metadata))
        except grpc.aio.AioRpcError as e:
            raise PipelineError(f"stage {self.index} at {self.address}: "
                                f"{describe_error(e)}") from e

    async def assign(self, shape: PipelineShape, timeout_s: float) -> StageInfo:
        """Make this standby stage stage `self.index` of `shape` (it loads that layer range);
        PipelineError naming it when it refuses or does not answer."""
        try:
            return info_from_describe(await self.stub.Assign(
                assign_request(self.index, shape), timeout=timeout_s,
                metadata=self.metadata))
        except grpc.aio.AioRpcError as e:
            raise PipelineError(f"standby {self.address}: {describe_error(e)}") from e

    async def listen(self, epoch: int, token: bytes, timeout_s: float,
                     feedback: bool = False, transport: str = "tcp") -> str:
        """Make this stage listen for its upstream neighbour over `transport` ("tcp",
        "unix", "cuda_ipc", "nccl") (`feedback`: the first stage, for the last stage's
        sampled ids); returns the address to dial (host:port; "unix:@<name>"). Raises
        grpc.aio.AioRpcError when the stage refuses."""
        host = self.address.rpartition(":")[0] or "127.0.0.1"
        reply = await self.stub.Connect(listen_request(epoch, token, host, transport, feedback),
                                        timeout=timeout_s, metadata=self.metadata)
        return str(reply.address)

    async def connect(self, epoch: int, token: bytes, address: str, timeout_s: float,
                      feedback: bool = False, transport: str = "tcp") -> None:
        """Make this stage dial its downstream neighbour over `transport` (`feedback`: the
        last stage, the first stage's feedback listener) at `address`. Raises
        grpc.aio.AioRpcError when the link fails (e.g. UNAVAILABLE, FAILED_PRECONDITION)."""
        await self.stub.Connect(connect_request(epoch, token, address, transport, feedback),
                                timeout=timeout_s, metadata=self.metadata)

    def open_run(self) -> None:
        """Open a new Run stream (the stage drops every sequence of an older one)."""
        self.close_run()
        self._run = self.stub.Run(metadata=self.metadata)

    def close_run(self) -> None:
        if self._run is not None:
            self._run.cancel()
            self._run = None

    async def write(self, plans: pb.StepPlans) -> None:
        """Raises grpc.aio.AioRpcError or asyncio.InvalidStateError on a broken stream."""
        assert self._run is not None, "open_run() first"
        await self._run.write(plans)

    async def read(self) -> list[StageAnswer]:
        """The answers of the next StepResults message, oldest first. Raises PipelineError
        when the stage closed the stream."""
        assert self._run is not None, "open_run() first"
        msg = await self._run.read()
        if msg is grpc.aio.EOF:
            raise PipelineError(f"stage {self.index} closed its Run stream")
        assert isinstance(msg, pb.StepResults)
        return [StageAnswer(r.step_id, r.error,
                            outcome_from_result(r) if self.is_last and not r.error else None)
                for r in msg.results]

    async def drain(self, timeout_s: float) -> None:
        await self.stub.Drain(pb.DrainRequest(), timeout=timeout_s, metadata=self.metadata)

    async def close(self) -> None:
        self.close_run()
        await self.channel.close()


def describe_error(e: BaseException) -> str:
    """A one-line account of a failed call or pipeline error."""
    if isinstance(e, grpc.aio.AioRpcError):
        if e.code() is grpc.StatusCode.UNIMPLEMENTED:  # a server, but not a stage of ours
            return (f"UNIMPLEMENTED: {e.details()}: the server there is not a stagemesh "
                    "stage of this version (another service on that port?); check --stages")
        return f"{e.code().name}: {e.details()}"
    return str(e)
