"""The processes `stagemesh serve` starts end when it does, however it ends: a SIGKILL or
the kernel's OOM killer included, where serve runs no code of its own to stop them.

serve names itself in each child's environment (`supervisor_env`); the child, first thing
(`die_with_supervisor`), asks the kernel for SIGTERM when its parent dies (Linux's
PR_SET_PDEATHSIG) and so shuts down as it would on serve's own SIGTERM: a router drains,
a stage and a gateway stop. Elsewhere than Linux nothing is asked.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import MutableMapping

SUPERVISOR_ENV = "STAGEMESH_SUPERVISOR_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def supervisor_env() -> dict[str, str]:
    """The environment entry serve gives each child it starts."""
    return {SUPERVISOR_ENV: str(os.getpid())}


def die_with_supervisor(environ: MutableMapping[str, str] = os.environ) -> None:
    """In a process serve started: SIGTERM to this process when serve dies.

    The variable is taken out of `environ`, so this process's own children (a router's
    engine core and fronts, a stage's TP ranks), which watch their own parents, never read
    it. Raises SystemExit when serve is gone already (it died before the request took
    effect)."""
    supervisor = environ.pop(SUPERVISOR_ENV, None)
    if supervisor is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # not granted: the process runs on as it did before this existed
    if os.getppid() != int(supervisor):
        raise SystemExit("stagemesh: the `stagemesh serve` that started this process is gone")
