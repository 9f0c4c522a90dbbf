"""The router's front processes (`--api-processes N`: fronts 1..N-1; front 0 is the router's
own), started, watched and stopped by the router.

A front process that dies takes its clients' streams with it (their connections break).
The router then tells the core (`FrontGone`), which aborts that front's sequences and frees
their blocks on the core and, through the next plan, on every stage; and it starts a new
front process with a new front id in its place. Restarts are bounded: past
`RESTART_LIMIT` within `RESTART_WINDOW_S`, `failed` is set with the reason and the router
stops with an error (a front that keeps dying is a bug, not load). Stopping sends each
front process SIGTERM (it drains) and kills what is left after the given time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections import deque
from collections.abc import Callable

from router.front_process import ERROR_PREFIX, READY_LINE
from router.front_server import FrontConfig

log = logging.getLogger("stagemesh.router")

RESTART_LIMIT = 5
RESTART_WINDOW_S = 600.0
KILL_WAIT_S = 5.0


class FrontStartError(RuntimeError):
    """A front process could not start (its port, or it exited before serving)."""


class FrontProcesses:
    """Keeps `count` front processes running.

    make_config(front_id): the FrontConfig of a new front. on_gone(front_id): called once
    for each front process that ended, whatever the reason (the router tells the core).
    """

    def __init__(self, count: int, make_config: Callable[[int], FrontConfig],
                 on_gone: Callable[[int], None]) -> None:
        self.count = count
        self._make_config = make_config
        self._on_gone = on_gone
        self._next_id = 1
        self.procs: dict[int, asyncio.subprocess.Process] = {}  # front id -> process
        self.serving: set[int] = set()  # fronts that said they serve and have not exited
        self._tasks: set[asyncio.Task[None]] = set()
        self._restarts: deque[float] = deque()
        self.restarts = 0
        self.stopping = False
        self.failed = asyncio.Event()
        self.error = ""

    async def start(self) -> None:
        """Start every front process and wait until each serves. Raises FrontStartError."""
        started = [await self._spawn() for _ in range(self.count)]
        lines = await asyncio.gather(*(_first_line(proc) for _, proc in started))
        for front_id, proc in started:
            self._watch(front_id, proc)
        for (front_id, _), line in zip(started, lines, strict=True):
            if line != READY_LINE:
                self.stopping = True  # the router stops: no restarts
                raise FrontStartError(_start_failure(front_id, line))
        self.serving.update(front_id for front_id, _ in started)

    async def _spawn(self) -> tuple[int, asyncio.subprocess.Process]:
        front_id = self._next_id
        self._next_id += 1
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.front_process", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE)
        assert proc.stdin is not None
        proc.stdin.write(self._make_config(front_id).to_json().encode())
        await proc.stdin.drain()
        proc.stdin.close()
        self.procs[front_id] = proc
        return front_id, proc

    def _watch(self, front_id: int, proc: asyncio.subprocess.Process) -> None:
        task = asyncio.create_task(self._await_exit(front_id, proc), name=f"front-{front_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _await_exit(self, front_id: int, proc: asyncio.subprocess.Process) -> None:
        status = await proc.wait()
        self.procs.pop(front_id, None)
        self.serving.discard(front_id)
        self._on_gone(front_id)
        if self.stopping:
            return
        log.error("front process %d (pid %d) exited with status %d; the core aborts its "
                  "requests", front_id, proc.pid, status)
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) >= RESTART_LIMIT:
            self.error = (f"front processes exited {len(self._restarts) + 1} time(s) within "
                          f"{RESTART_WINDOW_S:.0f}s (the last: front {front_id}, status "
                          f"{status}); not restarting them again")
            self.failed.set()
            return
        self._restarts.append(now)
        self.restarts += 1
        new_id, new_proc = await self._spawn()
        if self.stopping:  # stop() began while it was starting
            new_proc.send_signal(signal.SIGTERM)
            return
        log.warning("started front process %d (pid %d) in place of front %d", new_id,
                    new_proc.pid, front_id)
        self._watch(new_id, new_proc)
        line = await _first_line(new_proc)
        if line == READY_LINE and new_proc.returncode is None:
            self.serving.add(new_id)
        elif new_proc.returncode is None:
            log.error("%s", _start_failure(new_id, line))

    async def stop(self, timeout_s: float, give_up: Callable[[], bool] = lambda: False
                   ) -> None:
        """SIGTERM every front process (each drains) and wait until they exited, `timeout_s`
        passed or `give_up()`; kill the rest. No restart after this."""
        self.stopping = True
        procs = dict(self.procs)
        for proc in procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while (any(p.returncode is None for p in procs.values())
               and time.monotonic() < deadline and not give_up()):
            await asyncio.sleep(0.05)
        for front_id, proc in procs.items():
            if proc.returncode is None:
                log.error("front process %d did not exit; killing it", front_id)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        with contextlib.suppress(TimeoutError):  # the watchers report them gone
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs.values()),
                                                  *self._tasks, return_exceptions=True),
                                   KILL_WAIT_S)
        for task in list(self._tasks):
            task.cancel()

    def pids(self) -> dict[int, int]:
        """Front id -> pid of the front processes running now."""
        return {front_id: proc.pid for front_id, proc in self.procs.items()}


async def _first_line(proc: asyncio.subprocess.Process) -> str:
    """The front process's status line (`ready` or `error: ...`); "" if it exited first."""
    assert proc.stdout is not None
    return (await proc.stdout.readline()).decode(errors="replace").strip()


def _start_failure(front_id: int, line: str) -> str:
    if line.startswith(ERROR_PREFIX):
        return f"front process {front_id}: {line.removeprefix(ERROR_PREFIX)}"
    return f"front process {front_id} exited before serving (its log says why)"
