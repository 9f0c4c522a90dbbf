"""SIGKILL of the first, the middle and the last stage of a 3-stage pipeline, and of one TP
rank of a TP=2 stage, each while 8 greedy streams run (real processes: `stagemesh serve`,
the default model on CPU). What brings the stage back is serve's own restart, as
Kubernetes would restart a pod; the router re-links the data plane and re-prefills. Every
stream must end with exactly the text of a fault-free run, and KV must return to idle on
the router and on every stage. A TP rank's death takes its stage down at once (its leader
watches the rank processes), a rank that hangs (stopped) within the hang limit (it stops
beating on its pipe to the leader), and a dead leader's ranks do not outlive it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable

import pytest

from stage_worker.tp_liveness import HANG_S
from tests.default_model import default_model_dir
from tests.mesh.harness import (
    SERVING,
    Mesh,
    greedy_streams,
    readiness,
    wait_idle,
    wait_status,
)

pytestmark = pytest.mark.slow

STREAMS, TOKENS = 8, 12
PROMPTS = [f"Write one sentence about the number {i}." for i in range(STREAMS)]


async def _streams(address: str, kill: Callable[[], None] | None = None) -> list[str]:
    """Every prompt's greedy text; `kill` is called once every stream has its first
    tokens."""
    return (await greedy_streams(address, PROMPTS, TOKENS, kill))[0]


def _signal_rank(rank: int, sig: int, leader: int, took: list[float]) -> Callable[[], None]:
    """A fault that sends `sig` to TP rank `rank` and waits (30 s at most) for its leader
    to go; appends to `took` how long that took."""
    def fault() -> None:
        at = time.monotonic()
        os.kill(rank, sig)
        while _alive(leader) and time.monotonic() - at < 30:
            time.sleep(0.02)
        took.append(time.monotonic() - at)
    return fault


def _sigkill(pid: int) -> Callable[[], None]:
    return lambda: os.kill(pid, signal.SIGKILL)


def _tp_ranks(stage_pid: int) -> list[int]:
    """The pids of a stage leader's TP rank processes."""
    out = subprocess.run(["pgrep", "-P", str(stage_pid), "-f", "stage_worker.tp_rank"],
                         capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigkill_of_any_stage_of_three_loses_no_stream() -> None:
    # A micro-batch per stage (serve's default on one machine's cores is one): a step of
    # each in flight when the stage dies.
    with Mesh("--model", str(default_model_dir()), "--stages", "3", "--num-blocks", "256",
              "--micro-batches", "3", "--recovery-budget", "120", "--step-timeout", "10",
              timeout=300) as mesh:
        want = asyncio.run(_streams(mesh.address))
        assert len(set(want)) > 1  # the prompts give different texts
        stub = mesh.stub()
        for victim in (0, 1, 2):
            before = mesh.pid(f"stage {victim}")
            got = asyncio.run(_streams(mesh.address, _sigkill(before)))
            assert got == want, f"stage {victim} killed"
            assert mesh.pid(f"stage {victim}") != before  # serve restarted it
            wait_status(mesh.address, SERVING, 60)
            stats = wait_idle(stub, timeout=60)
            assert len(stats.stages) == 3
        assert readiness(mesh.address) == SERVING


def test_sigkill_of_a_tp_rank_takes_its_stage_down_at_once_and_loses_no_stream() -> None:
    with Mesh("--model", str(default_model_dir()), "--stages", "2", "--tp", "2",
              "--micro-batches", "2", "--num-blocks", "256", "--recovery-budget", "120",
              "--step-timeout", "10", timeout=300) as mesh:
        want = asyncio.run(_streams(mesh.address))
        stub = mesh.stub()
        leader = mesh.pid("stage 1")
        (rank,) = _tp_ranks(leader)
        down_after: list[float] = []
        got = asyncio.run(_streams(mesh.address,
                                   _signal_rank(rank, signal.SIGKILL, leader, down_after)))
        assert got == want
        line = f"TP rank process {rank} exited"
        seen = [i for i, text in enumerate(mesh.proc.lines) if line in text]
        assert seen, mesh.proc.output[-3000:]
        assert down_after[0] < 2.0  # the leader saw its rank die and took the stage down
        assert not _alive(leader) and mesh.pid("stage 1") != leader  # restarted whole
        wait_status(mesh.address, SERVING, 60)
        wait_idle(stub, timeout=60)

        # The other way round: a leader SIGKILLed leaves no TP rank behind.
        leader = mesh.pid("stage 0")
        (rank,) = _tp_ranks(leader)
        got = asyncio.run(_streams(mesh.address, _sigkill(leader)))
        assert got == want
        deadline = time.monotonic() + 5  # its next beat finds the pipe broken
        while _alive(rank):
            assert time.monotonic() < deadline, "the dead leader's TP rank is still running"
            time.sleep(0.2)
        wait_status(mesh.address, SERVING, 60)
        wait_idle(stub, timeout=60)

        # A rank that hangs without dying (SIGSTOP): it stops beating, and its leader takes
        # the stage down within the hang limit (not at a collective's or the step's timeout).
        leader = mesh.pid("stage 1")
        (rank,) = _tp_ranks(leader)
        stopped_for: list[float] = []
        got = asyncio.run(_streams(mesh.address,
                                   _signal_rank(rank, signal.SIGSTOP, leader, stopped_for)))
        assert got == want
        assert any(f"TP rank process {rank} has not answered" in line
                   for line in mesh.proc.lines), mesh.proc.output[-3000:]
        assert stopped_for[0] < HANG_S + 2.0
        deadline = time.monotonic() + 5
        while _alive(rank):  # killed, though stopped
            assert time.monotonic() < deadline, "the stopped TP rank is still there"
            time.sleep(0.2)
        assert mesh.pid("stage 1") != leader  # restarted whole
        wait_status(mesh.address, SERVING, 60)
        wait_idle(stub, timeout=60)
