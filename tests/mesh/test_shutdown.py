"""SIGTERM: the router drains (readiness NOT_SERVING, new requests UNAVAILABLE, in-flight
ones finish), and `stagemesh serve` stops every process it started, TP ranks included;
also when the signal comes while the mesh (or a router) is still starting; and when serve
itself is SIGKILLed, every process it started ends by itself."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time

import grpc
import pytest

from router.client import RouterClient
from tests.default_model import default_model_dir
from tests.mesh.harness import Mesh, Proc, free_port, readiness
from tests.processes import child_pids, children_and_theirs, still_alive

pytestmark = pytest.mark.slow

LONG = 32  # tokens of the request in flight during the drain (inside the 30 s drain timeout
# even on a loaded 2-core CI machine, where 60 once took longer)


def test_sigterm_drains_then_stops_every_process() -> None:
    mesh = Mesh("--stages", "2", "--tp", "2", "--num-blocks", "256")
    try:
        pids = [mesh.proc.proc.pid, *mesh.pids.values()]
        for stage in ("stage 0", "stage 1"):
            pids += child_pids(mesh.pids[stage])  # the TP rank processes
        assert len(pids) >= 6  # launcher, router, 2 stage leaders, 2 TP ranks

        async def run() -> tuple[str | None, grpc.StatusCode, int, int, int]:
            """SIGTERM once the long request streams; once readiness is NOT_SERVING, the
            router's own count of running sequences shows the request is still in flight."""
            async with RouterClient(mesh.address) as client:
                received = 0
                first = asyncio.Event()
                finish: list[str | None] = []

                async def long() -> None:
                    nonlocal received
                    async for chunk in client.generate(prompt="Once upon a time",
                                                       max_tokens=LONG, ignore_eos=True,
                                                       temperature=0.0):
                        received += len(chunk.token_ids)
                        first.set()
                        if chunk.finish_reason is not None:
                            finish.append(chunk.finish_reason)

                task = asyncio.create_task(long())
                await first.wait()
                os.kill(mesh.pids["router"], signal.SIGTERM)
                while (status := readiness(mesh.address)) != 2:
                    await asyncio.sleep(0.05)
                running_at_drain = (await client.stats()).num_running
                try:
                    await client.complete(prompt="late", max_tokens=4)
                    late = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    late = e.code()
                await task
                return (finish[0] if finish else None), late, status, running_at_drain, received

        finished, late, status, running_at_drain, total = asyncio.run(run())
        assert status == 2  # NOT_SERVING at once
        assert late == grpc.StatusCode.UNAVAILABLE
        assert running_at_drain == 1  # the request was in flight while the router drained
        assert (finished, total) == ("length", LONG)  # and it finished whole
    finally:
        mesh.close()
    assert still_alive(pids, 30) == []


def test_sigterm_while_starting_stops_every_process_without_waiting_for_ready() -> None:
    """serve signalled while its stages load stops them and the router and exits at
    once; it does not wait for the mesh to come up first."""
    proc = Proc([sys.executable, "-m", "stagemesh", "serve", "--model", str(default_model_dir()),
                 "--port", str(free_port()), "--gateway-port", "0", "--device", "cpu",
                 "--stages", "2", "--num-blocks", "256"])
    try:
        deadline = time.monotonic() + 60
        while len(kids := child_pids(proc.proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)  # two stages and the router started, none ready yet
        assert len(kids) == 3, proc.output
        pids = children_and_theirs(proc.proc.pid)
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=60) == 0, proc.output
    finally:
        proc.stop(timeout=10)
    assert "stagemesh ready" not in proc.output, proc.output
    assert still_alive(pids, 30) == []


def test_a_killed_serve_takes_every_process_it_started_with_it() -> None:
    """serve SIGKILLed (or taken by the OOM killer) runs no code of its own: its router,
    stages, TP ranks and gateway end by themselves, as on a SIGTERM to serve. Every one of
    them, each of its threads included, runs under the --cpu-policy serve set."""
    mesh = Mesh("--stages", "2", "--tp", "2", "--model-impl", "null", "--num-blocks", "256",
                "--cpu-policy", "batch", gateway_port=free_port())
    try:
        pids = children_and_theirs(mesh.proc.proc.pid)
        assert len(pids) >= 7, pids  # router, its core, 2 stage leaders, 2 TP ranks, gateway
        policies = {}  # thread id -> its policy
        for pid in pids:
            for tid in map(int, os.listdir(f"/proc/{pid}/task")):
                with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                    policies[tid] = os.sched_getscheduler(tid)
        assert len(policies) > 2 * len(pids)  # gRPC's threads, the stages' step threads
        assert set(policies.values()) == {os.SCHED_BATCH}
        os.kill(mesh.proc.proc.pid, signal.SIGKILL)
        assert still_alive(pids, 30) == []
    finally:
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        mesh.close()


def test_a_router_signalled_while_it_awaits_its_stages_stops_at_once() -> None:
    """SIGTERM to a router whose stages never come (the start-up budget is 300 s): it and its
    engine core exit 0 within seconds, not when the budget runs out."""
    proc = Proc([sys.executable, "-m", "stagemesh", "router", "--model",
                 str(default_model_dir()), "--stages", "127.0.0.1:1", "--port",
                 str(free_port())])
    try:
        proc.wait_for(r"waiting for stages", timeout=60)
        pids = [proc.proc.pid, *child_pids(proc.proc.pid)]  # the router and its core
        assert len(pids) == 2, pids
        started = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=30) == 0, proc.output
        assert time.monotonic() - started < 10, proc.output
    finally:
        proc.stop(timeout=10)
    assert "shutdown before the pipeline came up" in proc.output
    assert "did not exit" not in proc.output and "Traceback" not in proc.output, proc.output
    assert still_alive(pids, 10) == []
