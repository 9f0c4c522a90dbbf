"""asyncio helpers the services share."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def unless_set(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> T | None:
    """`work`'s result, unless `stop` is set first (a signal, a Shutdown while a start
    waits): then `work` is cancelled, awaited through its own clean-up, and None returned.
    For work whose result is never None. Raises what `work` raises."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None
