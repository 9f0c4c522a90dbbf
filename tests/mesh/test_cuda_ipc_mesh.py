"""Two stages on one GPU linked over CUDA IPC, as real processes (`stagemesh serve`): the
same greedy tokens as over TCP (and over TCP with run-ahead off), the hop reported by
GetStats and GetModelInfo, and a stage SIGKILLed mid-run brought back with its IPC link
rebuilt, no request lost.

GPU only. The model is the directory in $STAGEMESH_GPU_MODEL (a checkpoint with its
tokenizer, e.g. `python -m benchmarks.make_random_model --shape smollm2-135m ...`)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from protos.stagemesh.v1 import inference_pb2 as pb
from router.client import RouterClient
from tests.mesh.harness import Mesh, wait_idle

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PROMPTS = [[random.Random(i).randrange(100, 20000) for _ in range(16 + 7 * i)]
           for i in range(8)]
TOKENS = 32


@pytest.fixture(scope="module")
def model() -> Path:
    path = os.environ.get("STAGEMESH_GPU_MODEL")
    if not path:
        pytest.skip("set STAGEMESH_GPU_MODEL to a model directory with its tokenizer "
                    "(python -m benchmarks.make_random_model)")
    return Path(path)


def _mesh(model: Path, transport: str, *extra: str) -> Mesh:
    return Mesh("--model", str(model), "--device", "cuda", "--stages", "2",
                "--transport", transport, "--num-blocks", "2048", *extra, timeout=600)


async def _greedy_one_at_a_time(address: str) -> list[list[int]]:
    """Each prompt alone (batch 1: the same kernels whatever the transport)."""
    async with RouterClient(address) as client:
        return [(await client.complete(token_ids=p, temperature=0.0, max_tokens=TOKENS,
                                       ignore_eos=True)).token_ids[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def tcp_tokens(model: Path) -> list[list[int]]:
    with _mesh(model, "tcp") as mesh:
        assert list(mesh.stub().GetModelInfo(pb.GetModelInfoRequest()).hop_transports) == [
            "tcp"]
        return asyncio.run(_greedy_one_at_a_time(mesh.address))


@pytest.fixture(scope="module")
def ipc_mesh(model: Path) -> Iterator[Mesh]:
    with _mesh(model, "cuda_ipc") as mesh:
        yield mesh


def test_greedy_tokens_over_cuda_ipc_equal_tcp(ipc_mesh: Mesh,
                                               tcp_tokens: list[list[int]]) -> None:
    assert asyncio.run(_greedy_one_at_a_time(ipc_mesh.address)) == tcp_tokens
    stats = wait_idle(ipc_mesh.stub())
    assert [s.transport for s in stats.stages] == ["cuda_ipc", ""]
    info = ipc_mesh.stub().GetModelInfo(pb.GetModelInfoRequest())
    assert list(info.hop_transports) == ["cuda_ipc"]
    assert info.micro_batches == 1  # the two stages share the GPU: one step in flight


def test_greedy_tokens_with_run_ahead_equal_those_without(model: Path,
                                                         tcp_tokens: list[list[int]]) -> None:
    """With run-ahead (the default) stage 0 takes each decode's input late, on the GPU: a
    lane's step allocates its token ids on the device and the fill writes every row. The
    same greedy tokens as a mesh whose plans carry every input (`--no-run-ahead`)."""
    with _mesh(model, "tcp", "--no-run-ahead") as mesh:
        assert asyncio.run(_greedy_one_at_a_time(mesh.address)) == tcp_tokens


def test_a_killed_stage_comes_back_over_cuda_ipc_and_no_request_is_lost(
        ipc_mesh: Mesh) -> None:
    async def run() -> list[int]:
        async with RouterClient(ipc_mesh.address) as client:
            started = asyncio.Event()

            async def one(i: int) -> int:
                n = 0
                async for chunk in client.generate(token_ids=PROMPTS[i % 8], max_tokens=64,
                                                   temperature=0.0, ignore_eos=True,
                                                   timeout=600):
                    n += len(chunk.token_ids)
                    if n >= 4:
                        started.set()
                return n

            tasks = [asyncio.create_task(one(i)) for i in range(16)]
            await asyncio.wait_for(started.wait(), 120)
            os.kill(ipc_mesh.pid("stage 1"), signal.SIGKILL)
            return list(await asyncio.gather(*tasks))

    assert asyncio.run(run()) == [64] * 16
    stats = wait_idle(ipc_mesh.stub(), timeout=60)
    assert [s.transport for s in stats.stages] == ["cuda_ipc", ""]
    assert asyncio.run(_greedy_one_at_a_time(ipc_mesh.address))  # serves again
