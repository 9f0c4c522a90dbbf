"""Picking a free local port (the launcher, TP rendezvous, tests)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now. Another process may take it before the caller
    binds it; callers that can bind port 0 themselves should do that instead."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
