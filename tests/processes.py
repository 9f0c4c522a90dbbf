"""Process-table helpers for tests that check what a command leaves running (Linux /proc)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def child_pids(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def children_and_theirs(pid: int) -> list[int]:
    """The live children of `pid` and their own children (a launcher's services, and a
    router's core or a stage's TP ranks)."""
    return [p for kid in child_pids(pid) for p in (kid, *child_pids(kid))]


def alive(pid: int) -> bool:
    """`pid` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def still_alive(pids: list[int], timeout_s: float) -> list[int]:
    """Those of `pids` still running after waiting up to `timeout_s` for all to end."""
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if alive(p)]
