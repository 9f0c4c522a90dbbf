"""CUDA graphs at TP > 1: a group's collectives are capturable only over NCCL (gloo runs them
on the host), and on the GPU an NCCL all-reduce is captured and replayed. The TP = 2 run
itself needs two GPUs (the multi-GPU issue); here, one rank's NCCL group."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from stage_worker.parallel import TPGroup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def one_rank_group(request: pytest.FixtureRequest) -> Iterator[dist.ProcessGroup]:
    """A process group of this process alone, on the backend the test names."""
    backend = request.param
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    try:
        group = dist.new_group([0], backend=backend)
        assert group is not None
        yield group
    finally:
        dist.destroy_process_group()


def test_size_one_is_capturable_without_a_group() -> None:
    assert TPGroup().capturable


@pytest.mark.parametrize("one_rank_group", ["gloo"], indirect=True)
def test_a_gloo_group_is_not_capturable(one_rank_group: dist.ProcessGroup) -> None:
    # size 2 over a gloo group: its all-reduces run on the host, outside any graph
    assert not TPGroup(rank=0, size=2, group=one_rank_group).capturable


@pytest.mark.gpu
@pytest.mark.parametrize("one_rank_group", ["nccl"], indirect=True)
def test_an_nccl_all_reduce_replays_in_a_cuda_graph(one_rank_group: dist.ProcessGroup) -> None:
    assert TPGroup(rank=0, size=2, group=one_rank_group).capturable
    x = torch.arange(4096, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # eager first: creates the communicator
        y.copy_(x * 2)
        dist.all_reduce(y, group=one_rank_group)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.copy_(x * 2)
        dist.all_reduce(y, group=one_rank_group)
    x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)  # the replay read the new x and reduced (one rank: a sum of one)
