"""10x the sustainable load against a real `serve` (null model, 2 stages; the overload
benchmark's phases, shortened): the excess is refused at once with RESOURCE_EXHAUSTED and a
retry-after, nothing fails any other way, every admitted request finishes with all its
tokens, memory stays bounded, and when the load drops nothing is refused and latency is
back near the sustained run's; KV is idle at the end."""

from __future__ import annotations

import argparse
import asyncio
import math

import pytest

from benchmarks.overload import measure
from tests.default_model import default_model_dir
from tests.mesh.harness import Mesh, wait_idle

pytestmark = pytest.mark.slow


def test_ten_times_the_sustainable_load_is_refused_cleanly_and_the_mesh_recovers() -> None:
    # The sustainable rate of 2 closed-loop clients of 48-token requests and a running batch
    # of 32 keep 10x it (a few hundred requests a second) within what one front's event
    # loop accepts: far past that, gRPC itself drops calls before the router sees them
    # (docs/BENCHMARKS.md, "Overload and soak"). With 16-token requests the mesh of
    # 2026-12-05 sustains 63-80 a second, and at 10x that one call in two thousand ended
    # CANCELLED on the 2-core VM.
    args = argparse.Namespace(seed=0, prompt_len=32, output_len=48, concurrency=2,
                              duration=3.0, factor=10.0, soak=0.0, connections=16)
    with Mesh("--model", str(default_model_dir()), "--stages", "2", "--model-impl", "null",
              "--num-blocks", "1024", "--max-num-seqs", "32",
              "--max-queued-requests", "16") as mesh:
        result = asyncio.run(measure(mesh, args))
        wait_idle(mesh.stub())
    sustain, overload, recover = result["phases"]
    assert sustain["finished"] > 0 and sustain["refused"] == 0
    assert overload["refused"] > 0 and overload["finished"] > 0
    assert overload["refused_with_retry_after"] == overload["refused"]
    assert overload["other_errors"] == 0, overload["other_error_kinds"]
    assert overload["complete"] == overload["finished"]  # admitted ones end whole
    assert recover["refused"] == recover["other_errors"] == 0
    assert recover["complete"] == recover["sent"]
    assert recover["e2e_p50_ms"] < 3 * sustain["e2e_p50_ms"] + 100  # recovered
    for row in result["rss"]:  # bounded: the overload adds little to what the run began with
        start = row["start_max_mb"]
        assert not math.isnan(start)
        assert row["overload_max_mb"] < start + 150, row
    assert result["idle_after"] == {"kv_blocks_used": 0, "num_running": 0, "num_waiting": 0}
