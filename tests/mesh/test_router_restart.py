"""The router SIGKILLed under load and started again (real router and stage processes,
default model on CPU): its clients get UNAVAILABLE at once, never a hang; its engine core
exits with it; the stage drops the dead router's sequences (KV to idle) and accepts the
new router, which serves on the same port."""

from __future__ import annotations

import asyncio
import sys
import time

import grpc
import pytest

from protos.stagemesh.stage.v1 import stage_pb2, stage_pb2_grpc
from router.client import RouterClient
from tests.default_model import default_model_dir
from tests.mesh.harness import (
    SERVING,
    Proc,
    free_port,
    inference_pb2_grpc,
    streams_cut_by,
    wait_idle,
    wait_status,
)

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def _router(router_port: int, stage_port: int) -> Proc:
    return Proc([sys.executable, "-m", "stagemesh", "router", "--model",
                 str(default_model_dir()), "--stages", f"127.0.0.1:{stage_port}",
                 "--port", str(router_port)])


def _stage_usage(stage_port: int) -> tuple[int, int]:
    """(sequences, KV blocks) the stage holds."""
    with grpc.insecure_channel(f"127.0.0.1:{stage_port}") as channel:
        info = stage_pb2_grpc.StageServiceStub(channel).Describe(stage_pb2.DescribeRequest(),
                                                                 timeout=5)
        return info.num_sequences, info.kv_blocks_used


def test_a_killed_router_fails_its_streams_and_a_new_one_takes_over() -> None:
    stage_port, router_port = free_port(), free_port()
    address = f"127.0.0.1:{router_port}"
    stage = Proc([sys.executable, "-m", "stagemesh", "stage", "--model",
                  str(default_model_dir()), "--device", "cpu", "--num-blocks", "128",
                  "--port", str(stage_port)])
    routers = [_router(router_port, stage_port)]
    try:
        wait_status(address, SERVING, 120)
        async def kill_router() -> None:  # once the stage holds every stream's sequence
            deadline = time.monotonic() + 30
            while _stage_usage(stage_port)[0] < 4:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            routers[0].proc.kill()
        ended = asyncio.run(streams_cut_by(address, kill_router))
        assert all(code == grpc.StatusCode.UNAVAILABLE and seconds < 10
                   for code, _, seconds in ended), ended

        deadline = time.monotonic() + 30  # the core noticed and exited; its streams closed
        while _stage_usage(stage_port) != (0, 0):
            assert time.monotonic() < deadline, _stage_usage(stage_port)
            time.sleep(0.2)

        routers.append(_router(router_port, stage_port))
        wait_status(address, SERVING, 120)

        async def served() -> str:
            async with RouterClient(address) as client:
                out = await client.complete(messages=MESSAGES, temperature=0.0, max_tokens=8,
                                            timeout=60)
                return out.texts[0]
        assert asyncio.run(served())
        wait_idle(inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(address)))
    finally:
        for proc in [*routers, stage]:
            proc.stop()
