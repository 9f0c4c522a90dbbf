"""The mesh as real processes: router + stages (with TP ranks) over real sockets, on the
default model, against HF transformers' greedy tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from router.client import RouterClient
from tests.default_model import MAX_NEW, QUESTIONS, hf_greedy
from tests.mesh.harness import Mesh, wait_idle

pytestmark = pytest.mark.slow


# 3x1 also runs with a 32-token step budget: the ~37-token chat prompts are prefilled in
# chunks, interleaved with other sequences' decodes across the 3 micro-batches.
# The stages share this machine's cores: 2x2 runs serve's default, one micro-batch between
# them (stage 0 takes each step's inputs from the step just before); 3x1 asks for one per
# stage, three steps in flight.
@pytest.fixture(scope="module", params=[("--stages", "2", "--tp", "2"),
                                        ("--stages", "3", "--tp", "1", "--micro-batches", "3",
                                         "--max-num-batched-tokens", "32", "--max-num-seqs", "8")],
                ids=["2x2", "3x1-chunked"])
def mesh(request: pytest.FixtureRequest) -> Iterator[Mesh]:
    with Mesh(*request.param, "--num-blocks", "512") as m:
        yield m


def _messages(q: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": q}]


def test_micro_batches(mesh: Mesh) -> None:
    """Separate stage processes of one machine report one device: serve's default keeps
    one micro-batch between them; --micro-batches sets it."""
    async def run() -> tuple[int, int]:
        async with RouterClient(mesh.address) as client:
            info = await client.model_info()
        return info.num_stages, info.micro_batches

    stages, micro_batches = asyncio.run(run())
    assert micro_batches == (1 if stages == 2 else 3)


def test_greedy_tokens_equal_hf_transformers(mesh: Mesh) -> None:
    """The first half of HF's greedy answers (the whole answers are compared in process by
    tests/router/test_engine_inprocess.py and tests/stage_worker/test_default_model.py):
    the topology is what this test is for."""
    tokens = MAX_NEW // 2

    async def run() -> list[list[int]]:
        async with RouterClient(mesh.address) as client:
            outs = await asyncio.gather(*(
                client.complete(messages=_messages(q), temperature=0.0, max_tokens=tokens)
                for q in QUESTIONS))
        return [o.token_ids[0] for o in outs]

    assert asyncio.run(run()) == [want[:tokens] for want in hf_greedy()]
    wait_idle(mesh.stub())


def test_32_concurrent_streams_complete(mesh: Mesh) -> None:
    async def run() -> list[tuple[str | None, dict[str, int] | None, int]]:
        async with RouterClient(mesh.address) as client:
            outs = await asyncio.gather(*(
                client.complete(messages=_messages(QUESTIONS[i % 8]), max_tokens=12 + i % 5,
                                temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
                for i in range(32)))
        return [(o.finish_reasons[0], o.usage, len(o.token_ids[0])) for o in outs]

    results = asyncio.run(run())
    for i, (reason, usage, n_tokens) in enumerate(results):
        assert reason == "length"
        assert n_tokens == 12 + i % 5
        assert usage is not None and usage["completion_tokens"] == n_tokens
    wait_idle(mesh.stub())


def test_cancel_mid_stream_returns_kv_to_idle(mesh: Mesh) -> None:
    async def run() -> int:
        async with RouterClient(mesh.address) as client:
            got = 0
            stream = client.generate(messages=_messages("Tell me a long story."),
                                     max_tokens=400, ignore_eos=True, temperature=0.0)
            async for chunk in stream:
                got += len(chunk.token_ids)
                if got >= 5:
                    break
            await stream.aclose()  # cancels the call
            return got

    assert asyncio.run(run()) >= 5
    stats = wait_idle(mesh.stub())
    assert stats.kv_blocks_used == 0
    assert all(s.kv_blocks_used == 0 and s.num_sequences == 0 for s in stats.stages)
    assert len(stats.stages) in (2, 3)


def test_deadline_cancels_the_request(mesh: Mesh) -> None:
    async def run() -> grpc.StatusCode:
        async with RouterClient(mesh.address) as client:
            try:
                await client.complete(messages=_messages("Count to a thousand."),
                                      max_tokens=1000, ignore_eos=True, timeout=0.5)
            except grpc.aio.AioRpcError as e:
                return e.code()
        return grpc.StatusCode.OK

    assert asyncio.run(run()) == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(mesh.stub())
