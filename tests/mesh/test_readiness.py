"""Readiness follows the pipeline: NOT_SERVING until every stage is linked, and while one
is down; requests in flight when a stage dies pause and finish after it comes back."""

from __future__ import annotations

import asyncio
import sys
import time

import grpc
import pytest

from protos.stagemesh.v1 import inference_pb2_grpc
from router.client import RouterClient
from tests.default_model import default_model_dir
from tests.mesh.harness import (
    NOT_SERVING,
    SERVING,
    Proc,
    free_port,
    readiness,
    wait_idle,
    wait_status,
)

pytestmark = pytest.mark.slow

def _stage(port: int) -> Proc:
    return Proc([sys.executable, "-m", "stagemesh", "stage", "--model", str(default_model_dir()),
                 "--device", "cpu", "--num-blocks", "128", "--port", str(port)])


def test_readiness_tracks_the_stage_and_requests_survive_a_restart() -> None:
    stage_port, router_port = free_port(), free_port()
    router = Proc([sys.executable, "-m", "stagemesh", "router", "--model",
                   str(default_model_dir()), "--stages", f"127.0.0.1:{stage_port}",
                   "--port", str(router_port), "--recovery-budget", "120",
                   "--step-timeout", "10"])
    address = f"127.0.0.1:{router_port}"
    stage = None
    restarted: list[Proc] = []
    try:
        wait_status(address, NOT_SERVING, 30)  # listening, no stage yet
        time.sleep(1.0)
        assert readiness(address) == NOT_SERVING
        stage = _stage(stage_port)
        wait_status(address, SERVING, 120)

        messages = [{"role": "user", "content": "Tell me about the sea."}]

        async def reference() -> str:
            async with RouterClient(address) as client:
                out = await client.complete(messages=messages, temperature=0.0,
                                            max_tokens=60, ignore_eos=True)
                return out.texts[0]

        async def with_fault() -> list[str]:
            async with RouterClient(address) as client:
                started = asyncio.Event()

                async def one() -> str:
                    text = ""
                    async for chunk in client.generate(messages=messages, temperature=0.0,
                                                       max_tokens=60, ignore_eos=True,
                                                       timeout=300):
                        text += chunk.text
                        if len(text) > 20:
                            started.set()
                    return text
                tasks = [asyncio.create_task(one()) for _ in range(4)]
                await started.wait()  # mid-stream
                stage.proc.kill()
                await asyncio.to_thread(wait_status, address, NOT_SERVING, 60)
                restarted.append(_stage(stage_port))
                return list(await asyncio.gather(*tasks))

        want = asyncio.run(reference())
        texts = asyncio.run(with_fault())
        assert texts == [want] * 4  # the same text a fault-free run gives (greedy)
        wait_status(address, SERVING, 30)
        wait_idle(inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(address)))
    finally:
        router.stop()
        for proc in [stage, *restarted]:
            if proc is not None:
                proc.stop()
