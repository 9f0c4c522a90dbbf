"""A process serve starts asks the kernel for SIGTERM when serve dies, and hides serve's
pid from its own children; one whose serve is already gone ends at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from stagemesh.supervised import SUPERVISOR_ENV, die_with_supervisor, supervisor_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl")

_CHILD = """
import ctypes, os
from stagemesh.supervised import die_with_supervisor
die_with_supervisor()
sig = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
print(sig.value, os.environ.get("STAGEMESH_SUPERVISOR_PID"))
"""


def _child(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)


def test_a_child_of_serve_gets_sigterm_when_serve_dies_and_its_children_do_not_see_serve(
) -> None:
    done = _child(supervisor_env())  # this process plays serve
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(int(signal.SIGTERM)), "None"]


def test_a_child_whose_serve_is_gone_ends_with_one_line() -> None:
    done = _child({SUPERVISOR_ENV: "1"})  # not its parent: serve died before it asked
    assert done.returncode == 1
    assert done.stderr.strip() == ("stagemesh: the `stagemesh serve` that started this "
                                   "process is gone")


def test_a_process_serve_did_not_start_asks_nothing() -> None:
    environ: dict[str, str] = {}
    die_with_supervisor(environ)
    assert environ == {}
    done = _child({})
    assert done.stdout.split() == ["0", "None"]
