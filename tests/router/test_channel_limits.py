"""The receive limits the router's channels set (64 MiB): a peer that answers with more —
a stage answering the router, a router answering a client or the gateway — gets the call
ended RESOURCE_EXHAUSTED on the receiving side, named, never a process allocating it all.
Real gRPC servers on loopback that send 65 MiB answers. And a pipeline's stage calls while
it comes up never outlive the start's budget (a stage that never answers)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc
import pytest

from protos.stagemesh.stage.v1 import stage_pb2, stage_pb2_grpc
from protos.stagemesh.v1 import inference_pb2, inference_pb2_grpc
from router.client import RouterClient
from router.pipeline.shape import PipelineError
from router.pipeline.stage_client import StageClient

HUGE = "x" * (65 << 20)  # past the 64 MiB every router channel accepts


class _BigStage(stage_pb2_grpc.StageServiceServicer):
    async def Describe(self, request: stage_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> stage_pb2.DescribeResponse:
        return stage_pb2.DescribeResponse(model_impl=HUGE)


class _BigRouter(inference_pb2_grpc.InferenceServiceServicer):
    async def GetModelInfo(self, request: inference_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext
                           ) -> inference_pb2.GetModelInfoResponse:
        return inference_pb2.GetModelInfoResponse(model=HUGE)


@asynccontextmanager
async def _serving(add: Callable[[grpc.aio.Server], None]) -> AsyncIterator[str]:
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 128 << 20)])
    add(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def test_a_stage_answer_past_the_limit_ends_the_call_and_names_the_stage() -> None:
    async def body() -> str:
        add = lambda s: stage_pb2_grpc.add_StageServiceServicer_to_server(_BigStage(), s)  # noqa: E731
        async with _serving(add) as address:
            client = StageClient(0, address, is_last=True)
            try:
                with pytest.raises(PipelineError) as info:
                    await client.describe(30)
                return str(info.value)
            finally:
                await client.close()

    message = asyncio.run(body())
    assert message.startswith("stage 0 at 127.0.0.1:")
    assert "RESOURCE_EXHAUSTED" in message and str(64 << 20) in message


def test_a_router_answer_past_the_limit_ends_the_clients_call() -> None:
    async def body() -> tuple[grpc.StatusCode, str]:
        add = lambda s: inference_pb2_grpc.add_InferenceServiceServicer_to_server(  # noqa: E731
            _BigRouter(), s)
        async with _serving(add) as address, RouterClient(address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.model_info(timeout=30)
            return info.value.code(), info.value.details() or ""

    code, details = asyncio.run(body())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(64 << 20) in details


class _SilentStage(stage_pb2_grpc.StageServiceServicer):
    async def Describe(self, request: stage_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> stage_pb2.DescribeResponse:
        await asyncio.sleep(30)
        return stage_pb2.DescribeResponse()


def test_a_pipeline_start_never_outlives_its_budget_on_a_silent_stage() -> None:
    """Each stage call made while the pipeline comes up is bounded by the start's remaining
    budget, not only by its own timeout (10 s here): a 1 s budget ends in about 1 s."""
    from router.pipeline.driver import Pipeline

    async def body() -> float:
        add = lambda s: stage_pb2_grpc.add_StageServiceServicer_to_server(  # noqa: E731
            _SilentStage(), s)
        async with _serving(add) as address:
            pipeline = Pipeline([address], connect_timeout_s=10.0)
            started = time.monotonic()
            with pytest.raises(PipelineError, match="did not come up within 1s"):
                await pipeline.start(1.0)
            took = time.monotonic() - started
            await pipeline.close(drain=False)
            return took

    assert asyncio.run(body()) < 2.5


def test_a_server_that_is_no_stage_is_named_as_such() -> None:
    """A --stages address where another gRPC service listens (the router's own port, say)
    answers UNIMPLEMENTED: the start's error says that server is not a stage."""
    from router.pipeline.driver import Pipeline

    async def body() -> None:
        add = lambda s: inference_pb2_grpc.add_InferenceServiceServicer_to_server(  # noqa: E731
            inference_pb2_grpc.InferenceServiceServicer(), s)
        async with _serving(add) as address:
            pipeline = Pipeline([address], connect_timeout_s=10.0)
            with pytest.raises(PipelineError, match=f"stage 0 at {address}: UNIMPLEMENTED: .*"
                               "the server there is not a stagemesh stage"):
                await pipeline.start(1.0)
            await pipeline.close(drain=False)

    asyncio.run(body())
