"""`freeze_startup_heap`: start-up garbage is collected first, what lives is frozen."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from foundation.gc_heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    """Each test starts and ends with nothing frozen (the rest of the suite collects as
    usual)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_start_up_garbage_is_collected_before_the_heap_is_frozen() -> None:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle: only the cyclic collector frees it
    dead = weakref.ref(a)
    del a, b
    live = _Node()
    frozen = freeze_startup_heap("test")
    assert dead() is None  # frozen garbage could never be freed: it went first
    assert frozen == gc.get_freeze_count() > 0
    assert not gc.is_finalized(live)
    assert all(o is not live for o in gc.get_objects())  # frozen: no generation holds it


def test_cycles_made_after_the_freeze_are_still_collected() -> None:
    freeze_startup_heap("test")
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    dead = weakref.ref(a)
    del a, b
    gc.collect()
    assert dead() is None
