"""A client that goes away mid-request cancels its router calls: KV usage returns to idle on
the router and on every stage.

Each request asks for 3000 tokens with EOS ignored, which takes over a minute of decoding on
this CPU mesh; `wait_idle` gives 10 s, so only a cancellation can pass.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx2 as httpx
import openai
import pytest

from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc
from tests.gateway.conftest import MODEL
from tests.mesh.harness import wait_idle
from tests.prom import sample

pytestmark = pytest.mark.slow

LONG: dict[str, Any] = dict(model=MODEL, temperature=0, max_tokens=3000,
                            extra_body={"ignore_eos": True})
CANCEL_WITHIN_S = 10.0


def _metric(base_url: str, name: str, **labels: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    value = sample(text, name, **labels)
    assert value is not None, f"{name} not in /metrics:\n{text}"
    return value


def _busy_everywhere(stub: inference_pb2_grpc.InferenceServiceStub,
                     running: int) -> pb.GetStatsResponse:
    """Wait until `running` sequences or more hold KV blocks on the router and every stage."""
    deadline = time.monotonic() + 20
    while True:
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=5)
        if stats.num_running >= running and stats.kv_blocks_used > 0 and all(
                s.kv_blocks_used > 0 for s in stats.stages):
            return stats
        assert time.monotonic() < deadline, f"never busy:\n{stats}"
        time.sleep(0.05)


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def test_sync_stream_closed_mid_way_frees_kv_everywhere(
        client: openai.OpenAI, stub: inference_pb2_grpc.InferenceServiceStub,
        base_url: str) -> None:
    wait_idle(stub)
    before = _metric(base_url, "stagemesh_gateway_client_disconnects_total")
    stream = client.completions.create(prompt="Once upon a time", stream=True, **LONG)
    chunks = iter(stream)
    for _ in range(3):
        assert next(chunks).choices[0].text is not None
    stats = _busy_everywhere(stub, running=1)
    assert len(stats.stages) == 2
    assert _metric(base_url, "stagemesh_kv_blocks_used", stage="1") > 0
    stream.close()
    wait_idle(stub, timeout=CANCEL_WITHIN_S)
    assert _metric(base_url, "stagemesh_kv_blocks_used", stage="0") == 0
    assert _metric(base_url, "stagemesh_gateway_client_disconnects_total") == before + 1


def test_async_chat_stream_closed_mid_way_frees_kv_everywhere(
        base_url: str, stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    async def run() -> None:
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused",
                                      max_retries=0) as client:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": "Tell me a long story."}], n=2,
                stream=True, **LONG)
            async with stream:  # leaving it closes the response
                seen: set[int] = set()
                async for chunk in stream:
                    seen |= {c.index for c in chunk.choices}
                    if seen == {0, 1}:
                        break
                assert seen == {0, 1}
                await asyncio.to_thread(_busy_everywhere, stub, 2)

    wait_idle(stub)
    asyncio.run(run())
    idle = wait_idle(stub, timeout=CANCEL_WITHIN_S)
    assert idle.num_running == 0 and idle.kv_blocks_used == 0


def test_list_of_prompts_stream_closed_cancels_every_call(
        client: openai.OpenAI, stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    wait_idle(stub)
    stream = client.completions.create(prompt=["Once upon a time", "The sea is"], stream=True,
                                       **LONG)
    seen: set[int] = set()
    for chunk in stream:
        seen |= {c.index for c in chunk.choices}
        if seen == {0, 1}:
            break
    assert seen == {0, 1}
    assert _busy_everywhere(stub, running=2).num_running >= 2
    stream.close()
    idle = wait_idle(stub, timeout=CANCEL_WITHIN_S)
    assert idle.num_running == 0 and idle.kv_blocks_used == 0


def test_not_streamed_request_abandoned_frees_kv_everywhere(
        base_url: str, stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0,
            "max_tokens": 3000, "ignore_eos": True}

    async def run() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            request = asyncio.create_task(http.post("/v1/completions", json=body))
            await asyncio.to_thread(_busy_everywhere, stub, 1)
            request.cancel()  # closes the connection before any response
            with pytest.raises(asyncio.CancelledError):
                await request

    wait_idle(stub)
    asyncio.run(run())
    wait_idle(stub, timeout=CANCEL_WITHIN_S)
    text = httpx.get(base_url + "/metrics").text
    assert (sample(text, "stagemesh_gateway_requests_total", route="/v1/completions",
                   method="POST", status="499") or 0) >= 1, text
