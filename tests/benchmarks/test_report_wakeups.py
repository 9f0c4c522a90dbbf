"""`benchmarks.report`'s wake-up and preemption counts: a thread that blocks and is woken
counts once as a wake-up, one whose core is taken while it could run as a preemption, and a
process tree's counts are summed by role (Linux /proc)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.report import preemptions, process_cpu, process_wakeups, wakeups

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")

_SLEEPER = "import time\nfor _ in range(200):\n    time.sleep(0.002)\ntime.sleep(30)\n"


def test_each_blocking_sleep_of_this_process_is_a_wake_up() -> None:
    before = wakeups(os.getpid())
    for _ in range(50):
        time.sleep(0.001)
    assert wakeups(os.getpid()) - before >= 50


def test_a_thread_that_never_blocks_is_preempted_not_woken() -> None:
    """Two busy processes on one core: each takes the core from the other when its slice
    ends, and neither ever blocks."""
    spin = "import os, time\nos.sched_setaffinity(0, {0})\nend = time.time() + 0.6\n" \
           "while time.time() < end: pass\n"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    try:
        time.sleep(0.3)  # both interpreters are up and spinning
        before = {p.pid: (preemptions(p.pid), wakeups(p.pid)) for p in busy}
        time.sleep(0.2)
        after = {p.pid: (preemptions(p.pid), wakeups(p.pid)) for p in busy}
        assert all(after[pid][0] - before[pid][0] >= 2 for pid in before), (before, after)
        assert all(after[pid][1] - before[pid][1] <= 1 for pid in before), (before, after)
    finally:
        for p in busy:
            p.wait()


def test_a_childs_wake_ups_are_counted_under_its_role() -> None:
    child = subprocess.Popen([sys.executable, "-c", _SLEEPER])
    try:
        time.sleep(0.05)  # the interpreter is up and sleeping
        before = process_wakeups(os.getpid())
        time.sleep(0.5)  # at least a hundred of the child's 2 ms sleeps end meanwhile
        after = process_wakeups(os.getpid())
        # Neither this process nor the child names a mesh role: both count as "other".
        assert after["other"] - before.get("other", 0) >= 100
        assert process_cpu(os.getpid())["other"] > 0
    finally:
        child.kill()
        child.wait()
