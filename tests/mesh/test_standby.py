"""A standby stage takes the place of a stage that is lost and does not come back (real
processes: two stages, one standby, a router with --standby-stages; the default model on
CPU). The 16 greedy streams running when stage 1 is SIGKILLed end with exactly the text of
a fault-free run; KV returns to idle; the standby is stage 1 from then on. (The time to
resume against a restart in place: `benchmarks/failover.py`.)"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Iterator

import grpc
import pytest

from foundation.ports import free_port
from protos.stagemesh.stage.v1 import stage_pb2, stage_pb2_grpc
from protos.stagemesh.v1 import inference_pb2_grpc
from stagemesh.local_mesh import Proc
from tests.default_model import default_model_dir
from tests.mesh.harness import SERVING, greedy_streams, wait_idle, wait_status

pytestmark = pytest.mark.slow

STREAMS, TOKENS = 16, 12
PROMPTS = [f"Write one sentence about the number {i}." for i in range(STREAMS)]


async def _streams(address: str, fault: Callable[[], None] | None = None
                   ) -> tuple[list[str], float]:
    return await greedy_streams(address, PROMPTS, TOKENS, fault)


@pytest.fixture(scope="module")
def mesh() -> Iterator[dict[str, Proc | str]]:
    model = str(default_model_dir())
    cmd = [sys.executable, "-m", "stagemesh"]
    ports = [free_port() for _ in range(4)]
    stage = [*cmd, "stage", "--model", model, "--device", "cpu", "--num-blocks", "256",
             "--num-stages", "2", "--max-num-seqs", "32"]
    procs = {
        "stage 0": Proc([*stage, "--stage-index", "0", "--port", str(ports[0])]),
        "stage 1": Proc([*stage, "--stage-index", "1", "--port", str(ports[1])]),
        "standby": Proc([*stage, "--standby", "--port", str(ports[2])]),
    }
    procs["router"] = Proc([*cmd, "router", "--model", model, "--port", str(ports[3]),
                            "--stages", f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}",
                            "--standby-stages", f"127.0.0.1:{ports[2]}",
                            "--standby-grace", "2", "--recovery-budget", "120",
                            "--step-timeout", "10", "--max-num-seqs", "32",
                            "--micro-batches", "2"])  # a step of each stage in flight
    address = f"127.0.0.1:{ports[3]}"
    try:
        wait_status(address, SERVING, 240)
        yield {**procs, "address": address, "standby address": f"127.0.0.1:{ports[2]}",
               "stage 0 address": f"127.0.0.1:{ports[0]}"}
    finally:
        for p in reversed(procs.values()):
            p.stop(timeout=30)


def _describe(address: str) -> stage_pb2.DescribeResponse:
    with grpc.insecure_channel(address) as channel:
        return stage_pb2_grpc.StageServiceStub(channel).Describe(stage_pb2.DescribeRequest(),
                                                                 timeout=10)


def test_a_standby_refuses_other_calls_and_a_stage_refuses_assign(
        mesh: dict[str, Proc | str]) -> None:
    """Runs before the takeover below (module order): the standby is still unassigned."""
    with grpc.insecure_channel(str(mesh["standby address"])) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        assert stub.Describe(stage_pb2.DescribeRequest(), timeout=10).standby
        with pytest.raises(grpc.RpcError) as e:
            stub.Connect(stage_pb2.ConnectRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as e:  # stage 1 of 2 cannot start at layer 0
            stub.Assign(_assign(layer_start=0), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stage 1 of 2 cannot hold layers 0-29" in (e.value.details() or "")
    with grpc.insecure_channel(str(mesh["stage 0 address"])) as channel:
        with pytest.raises(grpc.RpcError) as e:
            stage_pb2_grpc.StageServiceStub(channel).Assign(_assign(), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "this stage is not a standby: it is stage 0 of 2" in (e.value.details() or "")


def _assign(layer_start: int = 15) -> stage_pb2.AssignRequest:
    return stage_pb2.AssignRequest(stage_index=1, num_stages=2, layer_start=layer_start,
                                   layer_end=30, num_kv_blocks=256,
                                   max_num_batched_tokens=2048, max_num_seqs=32)


def test_a_standby_takes_the_place_of_a_lost_stage_and_no_stream_is_lost(
        mesh: dict[str, Proc | str]) -> None:
    address, standby = str(mesh["address"]), str(mesh["standby address"])
    assert _describe(standby).standby
    want, _ = asyncio.run(_streams(address))
    victim = mesh["stage 1"]
    assert isinstance(victim, Proc)
    got, resumed_s = asyncio.run(_streams(address, lambda: victim.proc.send_signal(
        signal.SIGKILL)))
    assert got == want
    wait_status(address, SERVING, 60)
    stats = wait_idle(inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(address)),
                      timeout=60)
    assert len(stats.stages) == 2 and stats.stages[1].kv_blocks_total == 256
    took_over = _describe(standby)
    assert (took_over.standby, took_over.stage_index, took_over.num_stages) == (False, 1, 2)
    router = mesh["router"]
    assert isinstance(router, Proc)
    assert f"standby {standby} takes over its layers" in router.output
    assert f"stage 1 is now {standby}" in router.output
    print(f"standby: every stream had a token again {resumed_s:.1f}s after the kill")
    assert 0 < resumed_s < 60
    again, _ = asyncio.run(_streams(address))  # the standby serves on as stage 1
    assert again == want
