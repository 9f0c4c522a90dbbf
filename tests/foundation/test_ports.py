"""free_port: outside the kernel's ephemeral range, bindable, never the same twice."""

from __future__ import annotations

import socket

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
