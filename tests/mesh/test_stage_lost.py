"""A stage that never comes back (real router, stage and gateway processes, default model
on CPU): once the recovery budget runs out, the streams it interrupted end with UNAVAILABLE
naming the stage, readiness is NOT_SERVING, a new request fails at once (UNAVAILABLE over
gRPC, 503 over HTTP) naming it too, and nothing hangs. When the stage is started again
later, the mesh serves again and KV returns to idle."""

from __future__ import annotations

import asyncio
import sys
import time

import grpc
import httpx2 as httpx
import pytest

from router.client import RouterClient
from tests.default_model import default_model_dir
from tests.gateway.conftest import gateway
from tests.mesh.harness import (
    NOT_SERVING,
    SERVING,
    Proc,
    free_port,
    inference_pb2_grpc,
    readiness,
    streams_cut_by,
    wait_idle,
    wait_status,
)

pytestmark = pytest.mark.slow

BUDGET_S, STEP_TIMEOUT_S = 4.0, 5.0


def _stage(port: int) -> Proc:
    return Proc([sys.executable, "-m", "stagemesh", "stage", "--model", str(default_model_dir()),
                 "--device", "cpu", "--num-blocks", "128", "--port", str(port)])


def test_a_stage_that_never_returns_fails_its_requests_and_the_mesh_serves_when_it_does(
) -> None:
    stage_port, router_port = free_port(), free_port()
    address = f"127.0.0.1:{router_port}"
    router = Proc([sys.executable, "-m", "stagemesh", "router", "--model",
                   str(default_model_dir()), "--stages", f"127.0.0.1:{stage_port}",
                   "--port", str(router_port), "--recovery-budget", str(BUDGET_S),
                   "--step-timeout", str(STEP_TIMEOUT_S)])
    stages = [_stage(stage_port)]
    where = f"stage 0 at 127.0.0.1:{stage_port}"
    try:
        wait_status(address, SERVING, 120)
        with gateway(address) as url:
            async def kill_stage() -> None:
                stages[0].proc.kill()
            ended = asyncio.run(streams_cut_by(address, kill_stage))
            for code, message, seconds in ended:
                assert code == grpc.StatusCode.UNAVAILABLE, (code, message)
                assert where in message and "recovery budget" in message, message
                assert seconds < BUDGET_S + STEP_TIMEOUT_S + 15, seconds  # never hangs
            assert readiness(address) == NOT_SERVING

            started = time.monotonic()
            stub = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(address))

            async def fresh() -> None:
                async with RouterClient(address) as client:
                    await client.complete(prompt="Hello", max_tokens=4, timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                asyncio.run(fresh())
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert where in (info.value.details() or "")
            response = httpx.post(url + "/v1/completions", timeout=30,
                                  json={"prompt": "Hello", "max_tokens": 4})
            assert response.status_code == 503, response.text
            assert where in response.json()["error"]["message"]
            assert time.monotonic() - started < 10  # refused at once, not after a timeout

            stages.append(_stage(stage_port))  # back, later
            wait_status(address, SERVING, 120)
            answer = httpx.post(url + "/v1/completions", timeout=120,
                                json={"prompt": "Hello", "max_tokens": 4})
            assert answer.status_code == 200, answer.text
            wait_idle(stub)
    finally:
        router.stop()
        for stage in stages:
            stage.stop()
