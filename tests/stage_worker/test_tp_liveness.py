"""TP rank liveness beats: a beating rank is not hung, a silent one is after the limit, and
a rank whose leader is gone exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from stage_worker.tp_liveness import BEAT_S, FD_ENV, RankBeats
from tests.stage_worker.dataplane_helpers import REPO

_RANK = """
import os, time
from stage_worker.tp_liveness import FD_ENV, start_beating
start_beating(int(os.environ[FD_ENV]))
time.sleep(60)
"""


def _rank() -> tuple[subprocess.Popen[bytes], int]:
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", _RANK], pass_fds=(write_fd,), cwd=REPO,
                            env={**os.environ, FD_ENV: str(write_fd),
                                 "PYTHONPATH": str(REPO)})
    os.close(write_fd)
    return proc, read_fd


def test_a_beating_rank_is_not_hung_and_a_stopped_one_is() -> None:
    proc, fd = _rank()
    beats = RankBeats({proc.pid: fd})
    try:
        time.sleep(1.5)  # start-up and a few beats
        assert beats.hung(hang_s=1.0) is None
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(1.0 + 2 * BEAT_S)
        hung = beats.hung(hang_s=1.0)
        assert hung is not None and hung[0] == proc.pid and hung[1] >= 1.0
    finally:
        proc.kill()
        proc.wait(10)
        beats.close()


def test_a_rank_whose_leader_is_gone_exits() -> None:
    proc, fd = _rank()
    time.sleep(1.0)
    os.close(fd)  # the leader's end: as when the leader dies
    assert proc.wait(5) == 1


def test_a_rank_tells_a_gone_leader_from_a_live_one() -> None:
    """A rank whose collective broke exits with one line only when its leader (its parent
    when it started) is gone; with the leader alive the error is raised as it is."""
    from stage_worker.tp_rank import _gone

    started = time.monotonic()
    assert not _gone(os.getppid(), wait_s=0.2)  # this process's parent lives
    assert time.monotonic() - started >= 0.2
    assert _gone(os.getppid() + 1_000_000, wait_s=5.0)  # not its parent: at once
