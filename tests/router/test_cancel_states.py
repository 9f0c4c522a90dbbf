"""Cancelling a request in each state it can be in (in process: real gRPC servers and data
plane, the null model, 2 stages): while it waits in the queue, in the middle of a prefill
spread over many steps, between decode steps, and just after it finished. Each time the
router and every stage end idle (no block, no sequence held), the other requests are not
disturbed, and the mesh serves the next request normally."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import grpc
import pytest

from router.client import RouterClient, build_request
from tests.default_model import default_model_dir
from tests.router.inprocess import InProcessMesh, in_process_mesh, stage_configs
from tests.router.test_engine_inprocess import wait_idle


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


def _mesh(model_dir: Path, **router: object) -> AbstractAsyncContextManager[InProcessMesh]:
    stages = stage_configs(model_dir, 2, model_impl="null", num_blocks=512,
                           max_num_batched_tokens=32, max_num_seqs=4)
    return in_process_mesh(stages, **{"max_num_batched_tokens": 32, "max_num_seqs": 4, **router})


async def _until(condition: object, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.005)


async def _next_request_is_served(client: RouterClient) -> None:
    out = await client.complete(prompt="after", max_tokens=5, ignore_eos=True, timeout=30)
    assert len(out.token_ids[0]) == 5 and out.finish_reasons == ["length"]


def test_cancel_while_queued(model_dir: Path) -> None:
    """Behind `--max-num-seqs 1` on 2 stages (so two requests run, one per micro-batch)."""
    async def run() -> None:
        async with _mesh(model_dir, max_num_seqs=1) as mesh, mesh.client() as client:
            # One sequence per step, two micro-batches: two requests fill what runs.
            running = [asyncio.create_task(client.complete(
                prompt=f"first {i}", max_tokens=1500, ignore_eos=True, timeout=60))
                for i in range(2)]
            await _until(lambda: _stat(client, "num_running", 2))
            queued = client.generate(prompt="third", max_tokens=300, ignore_eos=True)
            waiting = asyncio.create_task(queued.__anext__())
            await _until(lambda: _stat(client, "num_waiting", 1))
            waiting.cancel()  # the client gives up while the request is still queued
            await asyncio.gather(waiting, return_exceptions=True)
            await queued.aclose()
            await _until(lambda: _stat(client, "num_waiting", 0))
            for out in await asyncio.gather(*running):  # undisturbed
                assert len(out.token_ids[0]) == 1500
            await wait_idle(client, mesh.stage_sequences)
            await _next_request_is_served(client)

    asyncio.run(run())


def test_cancel_mid_prefill(model_dir: Path) -> None:
    """A 1,200-token prompt in steps of 32 tokens: cancelled once the stages hold part of it
    and before its first token."""
    async def run() -> None:
        async with _mesh(model_dir) as mesh, mesh.client() as client:
            stream = client.generate(token_ids=[300 + i % 900 for i in range(1200)],
                                     max_tokens=4, ignore_eos=True)
            first = asyncio.create_task(stream.__anext__())

            async def prefilling() -> bool:
                stats = await client.stats()
                return bool(any(mesh.stage_sequences()) and stats.kv_blocks_used)
            await _until(prefilling)
            assert not first.done()  # no token yet: the prefill is under way
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            await stream.aclose()
            await wait_idle(client, mesh.stage_sequences)
            await _next_request_is_served(client)

    asyncio.run(run())


def test_cancel_just_after_the_finish(model_dir: Path) -> None:
    async def run() -> None:
        async with _mesh(model_dir) as mesh, mesh.client() as client:
            call = client.stub.Generate(build_request("done", max_tokens=6, ignore_eos=True),
                                        metadata=client.metadata)
            got = [msg async for msg in call]
            assert got[-1].HasField("usage")
            call.cancel()  # after the last message: nothing left to free
            assert await call.code() == grpc.StatusCode.OK
            await wait_idle(client, mesh.stage_sequences)
            await _next_request_is_served(client)

    asyncio.run(run())


async def _stat(client: RouterClient, name: str, want: int) -> bool:
    return int(getattr(await client.stats(), name)) == want
