"""What a stage reports as the device it computes on (Describe's device_id): stages that
report the same id take turns on it, so the router keeps one micro-batch between them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stage_worker.links import cpu_ranges, device_id, host_id


@pytest.mark.parametrize(("cpus", "want"), [
    ({0}, "0"), ({0, 1, 2, 5}, "0-2,5"), ([7, 3, 4, 3], "3-4,7"), ({1, 3, 5}, "1,3,5"),
])
def test_cpu_ranges(cpus: set[int] | list[int], want: str) -> None:
    assert cpu_ranges(cpus) == want


def test_a_cpu_stage_reports_its_host_and_cores() -> None:
    assert device_id("cpu") == f"cpu/{host_id()}/{cpu_ranges(os.sched_getaffinity(0))}"


REPO = Path(__file__).resolve().parents[2]
_PINNED = ("import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); "
           "from stage_worker.links import device_id; print(device_id('cpu'))")


def _pinned_device_id(cpu: int) -> str:
    """device_id("cpu") of a fresh process pinned to `cpu`."""
    done = subprocess.run([sys.executable, "-c", _PINNED, str(cpu)], cwd=REPO,
                          capture_output=True, text=True)
    if done.returncode and "PermissionError" in done.stderr:
        pytest.skip("this sandbox does not let a process set its CPU affinity")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin apart")
def test_cpu_stages_pinned_to_other_cores_are_other_devices() -> None:
    first, second = sorted(os.sched_getaffinity(0))[:2]
    assert [_pinned_device_id(first), _pinned_device_id(second)] == [
        f"cpu/{host_id()}/{first}", f"cpu/{host_id()}/{second}"]
