"""`benchmarks.report`'s wake-up counts: a thread that blocks and is woken counts once, and a
process tree's counts are summed by role (Linux /proc)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.report import process_cpu, process_wakeups, wakeups

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")

_SLEEPER = "import time\nfor _ in range(200):\n    time.sleep(0.002)\ntime.sleep(30)\n"


def test_each_blocking_sleep_of_this_process_is_a_wake_up() -> None:
    before = wakeups(os.getpid())
    for _ in range(50):
        time.sleep(0.001)
    assert wakeups(os.getpid()) - before >= 50


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
