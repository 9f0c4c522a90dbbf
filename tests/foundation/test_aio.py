"""unless_set: the work's result, or None with the work cancelled through its clean-up."""

from __future__ import annotations

import asyncio

import pytest

from foundation.aio import unless_set


def test_the_result_when_nothing_stops_it_and_its_error_as_raised() -> None:
    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    async def broken() -> int:
        raise ValueError("no")

    async def run() -> None:
        assert await unless_set(work(), asyncio.Event()) == 7
        with pytest.raises(ValueError, match="no"):
            await unless_set(broken(), asyncio.Event())

    asyncio.run(run())


def test_a_stop_first_cancels_the_work_through_its_clean_up() -> None:
    cleaned: list[str] = []

    async def work() -> int:
        try:
            await asyncio.sleep(60)
            return 1
        finally:
            cleaned.append("stopped what it started")

    async def run() -> int | None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, stop.set)
        return await unless_set(work(), stop)

    assert asyncio.run(run()) is None
    assert cleaned == ["stopped what it started"]
