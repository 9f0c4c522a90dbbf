"""gRPC message limits on the stage's control server (a real `stagemesh stage` process):
a message past the limit is refused with RESOURCE_EXHAUSTED before the stage reads it,
and the stage goes on serving. (The router's public port: `test_mesh_api`.)"""

from __future__ import annotations

import sys

import grpc
import pytest

from protos.stagemesh.stage.v1 import stage_pb2 as pb
from protos.stagemesh.stage.v1 import stage_pb2_grpc
from stage_worker.main import MAX_MESSAGE_BYTES
from tests.default_model import default_model_dir
from tests.mesh.harness import Proc, free_port

pytestmark = pytest.mark.slow


def test_an_oversized_plan_is_resource_exhausted_and_the_stage_serves_on() -> None:
    port = free_port()
    stage = Proc([sys.executable, "-m", "stagemesh", "stage", "--model",
                  str(default_model_dir()), "--model-impl", "null", "--device", "cpu",
                  "--num-blocks", "64", "--port", str(port)])
    try:
        stage.wait_for(r"serving on ", 120)
        options = [("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            stub.Describe(pb.DescribeRequest(), timeout=60, wait_for_ready=True)
            huge = pb.StepPlan(step_id=0, cached_batch=pb.CachedBatch(
                append_token_ids=bytes(MAX_MESSAGE_BYTES)))
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Run(iter([pb.StepPlans(plans=[huge])]), timeout=60))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert str(MAX_MESSAGE_BYTES) in (info.value.details() or "")
            info2 = stub.Describe(pb.DescribeRequest(), timeout=10)  # still serving
            assert info2.num_sequences == 0 and info2.kv_blocks_used == 0
    finally:
        stage.stop()
