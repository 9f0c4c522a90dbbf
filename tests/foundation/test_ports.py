"""free_port: outside the kernel's ephemeral range, bindable, never the same twice."""

from __future__ import annotations

import socket

import pytest

from foundation import ports


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low = ports._ephemeral_low()
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == len(got)
    for port in got:
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_returned(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        picks = iter([taken, taken, taken + 1])

        class FakeRandom:
            def randint(self, _a: int, _b: int) -> int:
                return next(picks)

        monkeypatch.setattr(ports.random, "SystemRandom", FakeRandom)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65000)
        port = ports.free_port()
        assert port != taken


def test_a_reserved_port_is_never_returned(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """serve reserves the router's and the gateway's ports, which bind later in their own
    processes; the ports it picks for the other children are never one of them."""
    monkeypatch.setattr(ports, "_handed_out", set())
    picks = iter([20_000, 20_001, 20_000, 20_002])

    class FakeRandom:
        def randint(self, _a: int, _b: int) -> int:
            return next(picks)

    monkeypatch.setattr(ports.random, "SystemRandom", FakeRandom)
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65000)
    ports.reserve(20_000, 20_001, 0)
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", 20_002))
        except OSError:
            pytest.skip("port 20002 is taken on this machine")
    assert ports.free_port() == 20_002


def test_the_kernel_fallback_never_returns_a_port_twice(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With no room below the ephemeral range the kernel picks, and its picks are recorded
    like the others: the same port is not returned twice."""
    held: set[int] = set()
    monkeypatch.setattr(ports, "_handed_out", held)
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 1000)  # no room below it
    got = [ports.free_port() for _ in range(20)]
    assert len(set(got)) == 20 and held == set(got)
