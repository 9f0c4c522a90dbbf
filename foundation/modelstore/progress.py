"""Progress lines on stderr for the model store's slow phases (download, extract, import).

stdout stays clean: `stagemesh fetch-model` prints only the model directory there.
"""

from __future__ import annotations

import sys
import time

_MB = 1e6


def say(message: str) -> None:
    """Print one `[model] …` progress line to stderr."""
    print(f"[model] {message}", file=sys.stderr, flush=True)


def megabytes(n_bytes: int) -> str:
    return f"{n_bytes / _MB:.1f} MB"


class ByteProgress:
    """Reports bytes done out of a known total.

    On a terminal one line is rewritten in place; otherwise (a log, a pipe) a line is printed
    at every 25 % so logs stay short.
    """

    def __init__(self, label: str, total: int) -> None:
        self._label = label
        self._total = max(total, 1)
        self._done = 0
        self._start = time.monotonic()
        self._tty = sys.stderr.isatty()
        self._next_step = 25  # next percentage printed when not on a terminal
        self._last_draw = 0.0

    def advance(self, n_bytes: int) -> None:
        self._done += n_bytes
        percent = 100 * self._done // self._total
        if self._tty:
            now = time.monotonic()
            if now - self._last_draw >= 0.1 or self._done >= self._total:
                self._last_draw = now
                print(f"\r[model] {self._line(percent)}", end="", file=sys.stderr, flush=True)
        elif percent >= self._next_step:
            say(self._line(percent))
            while self._next_step <= percent:
                self._next_step += 25

    def finish(self) -> float:
        """Ends the progress line; returns the seconds since the start."""
        if self._tty:
            print(file=sys.stderr, flush=True)
        return time.monotonic() - self._start

    def _line(self, percent: int) -> str:
        return (
            f"{self._label}: {megabytes(self._done)} / {megabytes(self._total)} ({percent}%)"
        )
