"""Test helpers over a running mesh."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc
from router.client import RouterClient
from stagemesh.local_mesh import Mesh, Proc, free_port

__all__ = ["NOT_SERVING", "SERVING", "Mesh", "Proc", "free_port", "inference_pb2_grpc",
           "readiness", "streams_cut_by", "wait_idle", "wait_status"]

SERVING, NOT_SERVING = 1, 2


def readiness(address: str) -> int:
    """The `readiness` health status of a server (SERVING = 1, NOT_SERVING = 2)."""
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        reply = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
        return int(reply.status)


def wait_status(address: str, want: int, timeout: float) -> None:
    """Poll the `readiness` status until it is `want` (the listener may not be up yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if readiness(address) == want:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"readiness never became {want} within {timeout:.0f}s")


def wait_idle(stub: inference_pb2_grpc.InferenceServiceStub, timeout: float = 20.0
              ) -> pb.GetStatsResponse:
    """Poll GetStats until no KV block is used on the router or any stage."""
    deadline = time.monotonic() + timeout
    while True:
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=5)
        busy = stats.kv_blocks_used or stats.num_running or stats.num_waiting or any(
            s.kv_blocks_used or s.num_sequences for s in stats.stages)
        if not busy:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"KV usage did not return to idle:\n{stats}")
        time.sleep(0.1)


async def streams_cut_by(address: str, fault: Callable[[], Awaitable[None]], streams: int = 4
                         ) -> list[tuple[grpc.StatusCode, str, float]]:
    """`streams` long greedy streams; `fault()` once one of them has a token. Each stream's
    status, message and seconds from the end of `fault()` to its end; a stream that finishes
    is an error (the fault was to end it)."""
    async with RouterClient(address) as client:
        started = asyncio.Event()
        faulted_at: list[float] = []

        async def one() -> tuple[grpc.StatusCode, str, float]:
            try:
                async for chunk in client.generate(
                        messages=[{"role": "user", "content": "Tell me about the sea."}],
                        temperature=0.0, max_tokens=400, ignore_eos=True, timeout=120):
                    if chunk.token_ids:
                        started.set()
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or "", time.monotonic() - faulted_at[0]
            raise AssertionError("the stream finished although the fault should end it")

        tasks = [asyncio.create_task(one()) for _ in range(streams)]
        await started.wait()
        await fault()
        faulted_at.append(time.monotonic())
        return list(await asyncio.gather(*tasks))


async def greedy_streams(address: str, prompts: list[str], tokens: int,
                         fault: Callable[[], None] | None = None) -> tuple[list[str], float]:
    """Every prompt's greedy chat text (`tokens` each, EOS ignored), streamed at once. With
    `fault`, called once every stream has 4 tokens: also the seconds from the fault until
    every stream had a token again (0.0 without one)."""
    async with RouterClient(address) as client:
        counts = [0] * len(prompts)
        started = asyncio.Event()
        fault_at: list[float] = []
        resumed = [0.0] * len(prompts)

        async def one(i: int) -> str:
            text = ""
            async for chunk in client.generate(
                    messages=[{"role": "user", "content": prompts[i]}], temperature=0.0,
                    max_tokens=tokens, ignore_eos=True, timeout=300):
                text += chunk.text
                counts[i] += len(chunk.token_ids)
                if fault_at and not resumed[i]:
                    resumed[i] = time.monotonic()
                if min(counts) >= 4:
                    started.set()
            return text

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        if fault is not None:
            await asyncio.wait_for(started.wait(), 120)
            fault()
            fault_at.append(time.monotonic())
        texts = list(await asyncio.gather(*tasks))
        return texts, (max(resumed) - fault_at[0]) if fault_at and all(resumed) else 0.0

