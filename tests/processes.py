"""Process-table helpers for tests that check what a command leaves running (Linux /proc)."""

from __future__ import annotations

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
