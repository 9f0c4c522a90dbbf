"""A stage serves only its paired router (real `stagemesh serve`, 2 stages, null model):
`serve` gives the router and its stages one secret (in their environment), the router
presents it on every StageService call, and a stage refuses any call without it
(UNAUTHENTICATED, naming the pairing): a caller that can reach a stage's port can neither
read it, link its data plane, take over its Run stream nor drain it. Health checks stay open
for probes, and the pipeline serves as before."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.stagemesh.stage.v1 import stage_pb2 as pb
from protos.stagemesh.stage.v1 import stage_pb2_grpc
from router.client import RouterClient
from tests.default_model import default_model_dir
from tests.mesh.harness import Mesh, wait_idle

pytestmark = pytest.mark.slow


def _stage_address(mesh: Mesh, index: int) -> str:
    for line in mesh.proc.lines:
        if line.strip().startswith(f"stage {index}") and " pid " in line:
            words = line.split()  # stage N pid PID ADDRESS [metrics URL]
            return words[words.index("pid") + 2]
    raise AssertionError(mesh.proc.output)


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer not-the-token"),)],
                         ids=["no token", "wrong token"])
def test_a_stage_refuses_every_caller_but_its_router(metadata: tuple[tuple[str, str], ...]
                                                      ) -> None:
    with Mesh("--model", str(default_model_dir()), "--stages", "2", "--model-impl", "null",
              "--num-blocks", "128") as mesh:
        address = _stage_address(mesh, 1)
        with grpc.insecure_channel(address) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            calls = {
                "Describe": lambda: stub.Describe(pb.DescribeRequest(), timeout=10,
                                                  metadata=metadata),
                "Connect": lambda: stub.Connect(pb.ConnectRequest(
                    role=pb.LINK_ROLE_LISTEN_UPSTREAM, address="127.0.0.1", epoch=99,
                    link_token=bytes(32)), timeout=10, metadata=metadata),
                "Run": lambda: list(stub.Run(iter([pb.StepPlans()]), timeout=10,
                                             metadata=metadata)),
                "Drain": lambda: stub.Drain(pb.DrainRequest(), timeout=10, metadata=metadata),
            }
            for name, call in calls.items():
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
                assert "paired router" in (info.value.details() or ""), name
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING

        async def served() -> list[int]:  # the router's own calls still go through
            async with RouterClient(mesh.address) as client:
                out = await client.complete(prompt="paired", max_tokens=6, ignore_eos=True)
                return out.token_ids[0]
        assert len(asyncio.run(served())) == 6
        wait_idle(mesh.stub())
