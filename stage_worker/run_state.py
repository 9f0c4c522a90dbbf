"""A Run stream's bookkeeping on a stage: which steps are queued, how their outcomes reach
the event loop, and when a run that answers only failures must wake it. The service
(`stage_worker.service`) drives it; the worker thread reports into it."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from stage_worker.plan import StageOutcome


class QueuedStep(NamedTuple):
    """A step queued on the worker of a stage that answers every step: its outcome's
    future, and whether its plan lets the answer wait for the next step's (`hold_answer`)."""

    step_id: int
    future: asyncio.Future[StageOutcome]
    hold: bool


def discard(queued: asyncio.Queue[QueuedStep | None]) -> None:
    """Steps queued behind the end of a run: their outcomes (or skips) are not read."""
    while not queued.empty():
        item = queued.get_nowait()
        if item is not None:
            item.future.add_done_callback(ignore_result)


def ignore_result(future: asyncio.Future[StageOutcome]) -> None:
    if not future.cancelled():
        future.exception()


class SkippedStep(Exception):  # noqa: N818 (not an error: the run ended before the step)
    """A queued step whose run stopped (an earlier step failed, the stream closed) or was
    superseded by a newer Run or a drain."""


class QuietProgress:
    """How far the worker got on a Run stream of a stage that answers only a failed step
    (not the last stage): no future and no loop wake-up per step. The worker counts the
    steps it finished; the loop waits for that count only when it must (the worker's
    queue is full, or the stream ended and its steps finish first). The first failure is
    kept, to be answered.

    `submitted` is written by the loop thread only and `finished` by the worker only; a
    waiter is published before the count is read again, and the worker reads the waiter
    after counting, so no wake-up is lost (the GIL orders the two). The worker records a
    failure before it counts the step, so a loop that sees the step finished sees its
    failure too, before the loop hears of it (`failed`, then the `failure` event).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.submitted = 0
        self.finished = 0
        self.first_failure: tuple[int, BaseException] | None = None  # (step id, error)
        self.failure: asyncio.Future[None] = loop.create_future()  # set once one is kept
        self._waiter: asyncio.Future[None] | None = None

    @property
    def failed(self) -> bool:
        return self.first_failure is not None

    @property
    def backlog(self) -> int:
        return self.submitted - self.finished

    def step_done(self) -> None:
        """Worker thread: a step finished (run, failed or skipped)."""
        self.finished += 1
        if self._waiter is not None:
            self._loop.call_soon_threadsafe(self._wake)

    def fail_from_worker(self, step_id: int, error: BaseException) -> None:
        """Worker thread: step `step_id` failed (before `step_done` of that step)."""
        self._record(step_id, error)
        self._loop.call_soon_threadsafe(self._notify)

    def fail(self, step_id: int, error: BaseException) -> None:
        """Loop thread: as `fail_from_worker`; `SkippedStep` ends the run unanswered."""
        self._record(step_id, error)
        self._notify()

    async def wait_until_backlog(self, most: int) -> None:
        """Loop thread: until at most `most` steps are unfinished, or a step failed."""
        while self.backlog > most and not self.failed:
            self._waiter = self._loop.create_future()
            if self.backlog > most and not self.failed:
                await self._waiter
            self._waiter = None

    def _record(self, step_id: int, error: BaseException) -> None:
        if self.first_failure is None:  # the first failure is the one answered
            self.first_failure = (step_id, error)

    def _notify(self) -> None:
        if not self.failure.done():
            self.failure.set_result(None)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


@dataclass
class RunState:
    """One Run stream: its generation, whether its later steps must be skipped, and the
    outcome of every step queued and not yet answered (by step id); or, for a stage that
    answers only failures, `quiet` in place of the outcomes."""

    generation: int
    settler: Settler
    stopped: bool = False
    outcomes: dict[int, asyncio.Future[StageOutcome]] = field(default_factory=dict)
    quiet: QuietProgress | None = None
    # Steps whose plan says `hold_answer` (added by the loop as it queues them, taken by the
    # worker as it delivers them): their outcome need not wake the loop (`Settler.put`).
    held: set[int] = field(default_factory=set)

    def skip_unanswered(self) -> None:
        """Loop thread: every step still waiting ends as skipped (the run is over)."""
        self.settler.drain()  # outcomes put without a wake-up first
        for future in self.outcomes.values():
            if not future.done():
                future.set_exception(SkippedStep())
        self.outcomes.clear()
        if self.quiet is not None:
            self.quiet.fail(-1, SkippedStep())


def _settle(future: asyncio.Future[StageOutcome], outcome: StageOutcome | None,
            error: BaseException | None) -> None:
    """Loop thread: a step's outcome (or error) into its future, unless already settled."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(outcome)  # type: ignore[arg-type]


_Settlement = tuple[asyncio.Future[StageOutcome], StageOutcome | None, BaseException | None]


class Settler:
    """Hands the worker's outcomes to the event loop, one wake-up for all that are ready.

    The worker `put`s; the first put after the loop drained schedules one drain on the loop
    (a thread-safe call is a syscall and a loop wake-up: per step it cost as much as the
    rest of a non-last stage's answer path). Relies on the GIL for the deque and the flag:
    the flag is cleared before the drain reads, so a put racing with a drain at worst
    schedules one drain that finds nothing.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ready: deque[_Settlement] = deque()
        self._scheduled = False

    def put(self, future: asyncio.Future[StageOutcome], outcome: StageOutcome | None,
            error: BaseException | None, wake: bool = True) -> None:
        """Worker thread. `wake` False: the outcome waits for the next put that wakes the
        loop (the caller makes sure one comes: a later step's, which always settles)."""
        self._ready.append((future, outcome, error))
        if wake and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:
        """Loop thread: settle every outcome put so far."""
        self._scheduled = False
        ready = self._ready
        while ready:
            _settle(*ready.popleft())
