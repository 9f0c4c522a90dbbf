"""Liveness of a stage's TP rank processes, apart from their collectives.

A rank that dies is seen by its exit; a rank that hangs without dying (stopped, wedged in
a deadlock) would otherwise be seen only when a collective times out (minutes) or the
router's step timeout fires, and then the router would re-link to a stage whose group is
still stuck. So each rank beats on a pipe to its leader every `BEAT_S` from a thread of its
own (`start_beating`); the leader (`RankBeats`) takes the stage down when a rank has not
beaten for `hang_s`. A rank whose leader is gone (the pipe breaks) exits at once.
"""

from __future__ import annotations

import os
import threading
import time

BEAT_S = 0.5
HANG_S = 5.0  # no beat for this long: the rank is hung
FD_ENV = "STAGEMESH_TP_BEAT_FD"  # the write end, in a rank's environment


def start_beating(fd: int) -> None:
    """Rank side: beat on `fd` until the process ends; exit the process when the leader
    is gone (its end of the pipe closed)."""

    def beat() -> None:
        while True:
            try:
                os.write(fd, b".")
            except OSError:  # EPIPE: the leader died; this rank's group is gone with it
                os._exit(1)
            time.sleep(BEAT_S)

    threading.Thread(target=beat, daemon=True, name="tp-beat").start()


class RankBeats:
    """Leader side: the read ends of its ranks' pipes (non-blocking), and when each rank
    last beat."""

    def __init__(self, read_fds: dict[int, int]) -> None:
        """`read_fds`: rank pid -> read end of its pipe."""
        self._fds = read_fds
        now = time.monotonic()
        self._last = dict.fromkeys(read_fds, now)
        for fd in read_fds.values():
            os.set_blocking(fd, False)

    def hung(self, hang_s: float = HANG_S) -> tuple[int, float] | None:
        """(pid, seconds since its last beat) of a rank silent for `hang_s`, else None. A
        rank whose pipe closed (it exited) is left to the exit check."""
        now = time.monotonic()
        for pid, fd in self._fds.items():
            try:
                while os.read(fd, 4096):
                    self._last[pid] = now
            except BlockingIOError:
                pass
            silent = now - self._last[pid]
            if silent >= hang_s:
                return pid, silent
        return None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
