"""The stage's step thread: steps and awaited calls run in the order given, one at a time; a
step that fails is logged and the thread goes on; shutdown runs what is queued, or cancels
it."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import CancelledError

import pytest

from stage_worker.step_thread import StepThread


def test_steps_and_calls_run_in_order_on_one_thread() -> None:
    worker = StepThread("test-step")
    seen: list[tuple[str, int]] = []
    threads: set[str] = set()

    def note(kind: str, i: int) -> int:
        threads.add(threading.current_thread().name)
        seen.append((kind, i))
        return i * 10

    futures = []
    for i in range(50):
        worker.run_later(note, "step", i)
        if i % 10 == 0:
            futures.append(worker.submit(note, "call", i))
    assert [f.result(timeout=10) for f in futures] == [0, 100, 200, 300, 400]
    worker.shutdown(wait=True)
    want = [x for i in range(50) for x in
            ([("step", i), ("call", i)] if i % 10 == 0 else [("step", i)])]
    assert seen == want and threads == {"test-step"}


def test_a_failing_step_is_logged_and_the_thread_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    worker = StepThread("test-step")

    def fail() -> None:
        raise ValueError("boom")

    with caplog.at_level(logging.ERROR, logger="stagemesh.stage"):
        worker.run_later(fail)
        assert worker.submit(lambda: 7).result(timeout=10) == 7
    assert "work on the step thread failed" in caplog.text and "boom" in caplog.text
    failed = worker.submit(fail)
    with pytest.raises(ValueError, match="boom"):
        failed.result(timeout=10)
    worker.shutdown()


def test_the_event_loop_awaits_calls_through_run_in_executor() -> None:
    worker = StepThread("test-step")

    async def main() -> str:
        return await asyncio.get_running_loop().run_in_executor(
            worker, lambda: threading.current_thread().name)

    assert asyncio.run(main()) == "test-step"
    worker.shutdown()


def test_shutdown_runs_what_is_queued_or_cancels_it() -> None:
    worker = StepThread("test-step")
    gate = threading.Event()
    ran: list[int] = []
    worker.run_later(gate.wait, 10)
    worker.run_later(ran.append, 1)
    queued = worker.submit(ran.append, 2)
    closing = threading.Thread(target=worker.shutdown)
    closing.start()
    gate.set()
    closing.join(10)
    assert ran == [1, 2] and queued.done()
    with pytest.raises(RuntimeError, match="shut down"):
        worker.run_later(ran.append, 3)

    worker = StepThread("test-step")
    gate.clear()
    worker.run_later(gate.wait, 10)
    worker.run_later(ran.append, 4)
    cancelled = worker.submit(ran.append, 5)
    worker.shutdown(wait=False, cancel_futures=True)
    gate.set()
    with pytest.raises(CancelledError):
        cancelled.result(timeout=10)
    worker._thread.join(10)
    assert ran == [1, 2] and not worker._thread.is_alive()
