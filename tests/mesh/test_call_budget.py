"""A client's deadline bounds the stage calls made for it: GetStats with a 1.5 s deadline
while a stage is stopped (SIGSTOP: it holds its connections and never answers) is answered
in time, that stage reported not ready, instead of waiting out the core's own 2 s per stage
and ending DEADLINE_EXCEEDED."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from protos.stagemesh.v1 import inference_pb2 as pb
from tests.default_model import default_model_dir
from tests.mesh.harness import Mesh

pytestmark = pytest.mark.slow


def test_get_stats_answers_within_the_callers_deadline_with_a_stage_stopped() -> None:
    with Mesh("--model", str(default_model_dir()), "--stages", "2", "--model-impl", "null",
              "--num-blocks", "64", timeout=120) as mesh:
        stub = mesh.stub()
        assert all(s.ready for s in stub.GetStats(pb.GetStatsRequest(), timeout=10).stages)
        pid = mesh.pid("stage 1")
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=1.5)
            took = time.monotonic() - started
        except grpc.RpcError as e:
            pytest.fail(f"GetStats ended {e.code()} instead of answering in time")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert took < 1.5
        assert [s.ready for s in stats.stages] == [True, False]
        assert all(s.ready for s in stub.GetStats(pb.GetStatsRequest(), timeout=10).stages)
