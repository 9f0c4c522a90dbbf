"""`--cpu-policy`: which policy `serve` picks, and that what it sets reaches the threads and
processes started after it (the whole mesh: tests/mesh/test_shutdown.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

import pytest

from stagemesh import cpu_policy, launcher
from stagemesh.cli import main
from stagemesh.launcher import set_cpu_policy

needs_linux = pytest.mark.skipif(not cpu_policy.supported(), reason="SCHED_BATCH is Linux's")


@pytest.mark.parametrize(("asked", "busy", "cores", "chosen"), [
    ("auto", 4, 2, "batch"),  # W6: 2 stages, the core and a front on two cores
    ("auto", 3, 2, "batch"),  # the README's mesh on the CI machine
    ("auto", 4, 4, "normal"),  # one core each: nothing to preempt
    ("auto", 4, 16, "normal"),
    ("normal", 8, 2, "normal"),
    ("batch", 2, 16, "batch"),
])
def test_auto_is_batch_only_when_the_busy_processes_outnumber_the_cores(
        asked: str, busy: int, cores: int, chosen: str) -> None:
    assert cpu_policy.choose(asked, busy, cores) == chosen


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"'fifo'.*auto, normal, batch"):
        cpu_policy.choose("fifo", 1, 1)


def test_serve_refuses_an_unknown_policy_at_the_command_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--cpu-policy", "fifo"])
    assert e.value.code == 2
    assert "--cpu-policy: invalid choice: 'fifo'" in capsys.readouterr().err


def _serve_args(policy: str, stages: int = 2, tp: int = 1,
                engine_core: str = "process") -> argparse.Namespace:
    return argparse.Namespace(cpu_policy=policy, stages=stages, tp=tp, api_processes=1,
                              engine_core=engine_core)


@needs_linux
def test_auto_with_cores_to_spare_leaves_the_policy_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    applied: list[str] = []
    monkeypatch.setattr(cpu_policy, "apply", applied.append)
    monkeypatch.setattr(launcher, "usable_cores", lambda: 64)
    assert set_cpu_policy(_serve_args("auto")) is None
    assert set_cpu_policy(_serve_args("normal")) == "normal"  # asked: set, even if inherited
    monkeypatch.setattr(launcher, "usable_cores", lambda: 2)
    assert set_cpu_policy(_serve_args("auto")) == "batch"  # 2 stages, core, front: 4 > 2
    # A core that is a task of the front is no process of its own: 1 stage and the front.
    assert set_cpu_policy(_serve_args("auto", stages=1, engine_core="task")) is None
    assert set_cpu_policy(_serve_args("auto", stages=1)) == "batch"  # 3 > 2
    assert applied == ["normal", "batch", "batch"]


@needs_linux
def test_what_serve_sets_is_inherited_by_later_threads_and_processes() -> None:
    """In a process of its own (a policy set here would stay with the test process):
    serve's choice on one core, then a thread and a child process started after it."""
    script = textwrap.dedent("""
        import argparse, os, subprocess, sys, threading
        from stagemesh.launcher import set_cpu_policy
        def policy():  # the calling thread's
            return "batch" if os.sched_getscheduler(0) == os.SCHED_BATCH else "other"
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        args = argparse.Namespace(cpu_policy="auto", stages=1, tp=1, api_processes=1,
                                  engine_core="process")
        seen = [set_cpu_policy(args), policy()]
        thread = threading.Thread(target=lambda: seen.append(policy()))
        thread.start()
        thread.join()
        child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                               capture_output=True, text=True, check=True)
        seen.append(int(child.stdout) == os.SCHED_BATCH)
        print(seen)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=60)
    assert "--cpu-policy auto: batch (3 processes work on every step, 1 usable cores)" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "['batch', 'batch', 'batch', True]"
