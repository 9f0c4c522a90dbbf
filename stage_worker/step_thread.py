"""The stage's step thread: one thread that runs, in order, everything handed to it.

The `Run` stream's reader hands it every step (`run_later`: no future; the step settles its
own outcome or failure, see `StageServicer._run_step`), and the event loop the occasional
call it awaits (`submit`, through `loop.run_in_executor`: a future). One queue keeps the
two in the order they were given.

`ThreadPoolExecutor(max_workers=1)` did the same, but made every step a `Future` and a work
item and passed an idle semaphore each way (Python-level locks and conditions): about
11 µs of both threads' CPU a hand-off more than a bare queue, on every step.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from queue import SimpleQueue
from typing import Any, ParamSpec, TypeVar

log = logging.getLogger("stagemesh.stage")

_P = ParamSpec("_P")
_T = TypeVar("_T")
# (what to run, its future or None); None ends the thread.
_Item = tuple[Callable[[], Any], "Future[Any] | None"] | None


class StepThread(Executor):
    """One thread, started at construction, running what it is given in order."""

    def __init__(self, name: str) -> None:
        self._queue: SimpleQueue[_Item] = SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def run_later(self, fn: Callable[_P, object], /, *args: _P.args,
                  **kwargs: _P.kwargs) -> None:
        """Run `fn(*args, **kwargs)` on the thread after what is queued; no result. An
        exception it lets out is logged (the thread goes on).

        Raises:
            RuntimeError: after `shutdown`.
        """
        self._put((functools.partial(fn, *args, **kwargs), None))

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args,
               **kwargs: _P.kwargs) -> Future[_T]:
        """`Executor.submit`: `fn(*args, **kwargs)` on the thread, its result in the future."""
        future: Future[_T] = Future()
        self._put((functools.partial(fn, *args, **kwargs), future))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more work is taken; what is queued still runs (`cancel_futures`: the queued
        calls' futures are cancelled instead, and queued steps dropped). `wait`: until the
        thread has ended."""
        with self._lock:
            if not self._closed:
                self._closed = True
                if cancel_futures:
                    self._drop_queued()
                self._queue.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _put(self, item: _Item) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the step thread is shut down")
            self._queue.put(item)

    def _drop_queued(self) -> None:
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not None and item[1] is not None:
                item[1].cancel()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            call, future = item
            if future is None:
                try:
                    call()
                except BaseException:
                    log.exception("work on the step thread failed")
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call()
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(result)
