"""Writing a model directory atomically: a lock across the processes that may import the same
model at once, the marker that says an import finished (and of what), and the rename that
puts a finished import in place."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from foundation.modelstore.layout import IMPORT_MARKER
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


def marker_matches(dest: Path, identity: dict[str, Any]) -> bool:
    """Whether `dest` holds a finished import whose marker has every field of `identity`."""
    try:
        marker = json.loads((dest / IMPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(marker, dict) and all(marker.get(k) == v for k, v in identity.items())


def seal_import(tmp: Path, marker: dict[str, Any]) -> None:
    """Write the marker into the finished import `tmp` (last), give its files the mode the
    umask gives any new file, and flush everything to disk before the rename."""
    (tmp / IMPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    # mkdtemp makes the directory private (0700) and safetensors writes 0600: give the model
    # the mode the umask gives any new file (the marker's), so other accounts can serve it.
    file_mode = (tmp / IMPORT_MARKER).stat().st_mode & 0o666
    tmp.chmod(file_mode | (file_mode & 0o444) >> 2)  # x wherever r, for the directory
    for path in tmp.iterdir():
        path.chmod(file_mode)
        fsync(path)
    fsync(tmp)


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
