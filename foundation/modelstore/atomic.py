"""Writing a model directory atomically: a lock across the processes that may import the same
model at once, and the rename that puts a finished import in place."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from foundation.modelstore.progress import say


@contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """An advisory lock across processes (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with lock_path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another process is importing the model; waiting for {lock_path}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def swap_into_place(tmp: Path, dest: Path) -> None:
    """Renames `tmp` to `dest`, replacing an older `dest` (renamed aside, then deleted)."""
    old = dest.with_name(f".{dest.name}.{os.getpid()}.old")
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    fsync(dest.parent)
    shutil.rmtree(old, ignore_errors=True)


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
