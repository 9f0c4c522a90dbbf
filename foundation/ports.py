"""Picking a free local port for a listener that must be named before it starts (a stage the
router is told about, the TP rendezvous, tests).

A port from the kernel's ephemeral range is a poor choice: between "free now" and the bind,
the same number is handed out as the local end of some outgoing connection (gloo pairs, gRPC
channels) or to another listener that bound port 0, and the bind fails with "address already
in use". So ports are picked at random *below* the ephemeral range, where the kernel never
hands out a number on its own, and each is bind-checked. Callers that can bind port 0 and
report the bound port should do that instead.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; the IANA range starts higher still (49152)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def reserve(*ports: int) -> None:
    """Ports this process has promised elsewhere (a service's own --port, told to a child
    that binds it later): `free_port` never returns them. 0 (no port) is ignored."""
    _handed_out.update(p for p in ports if p)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now, outside the ephemeral range, neither returned
    before by this process nor `reserve`d in it. Another process may still take it before
    the caller binds it."""
    high = _ephemeral_low() - 1
    if high > _LOWEST:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randint(_LOWEST, high)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    while True:  # no room below the ephemeral range: let the kernel pick
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
