"""The gateway's connections to the router: `GatewayConfig.router_connections` clients, each
on a TCP connection of its own.

A router run with `--api-processes N` has N front processes on one port, and the kernel
spreads *connections* across them, not calls: everything sent on one HTTP/2 connection
reaches one front. With several connections the gateway's requests can reach several fronts
(which front each connection lands on is the kernel's choice, so two may share one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from gateway.config import GatewayConfig
from router.client import RouterClient


class RouterConnections:
    """Hands each new HTTP request's router calls to one of the clients.

    Choice: the client with the fewest router calls outstanding, ties broken round robin
    (the rotation starts after the client chosen last). Plain round robin evens out arrivals
    but not live streams: generations differ in length by orders of magnitude, so long ones
    could pile up on one connection by chance, and a front's per-token work grows with the
    streams it holds. Counting live calls costs one counter per client (every lease ends,
    also when the request is cancelled), and when the gateway is idle between requests the
    ties make it plain round robin.

    Lives on one event loop (a gRPC aio channel belongs to the loop that made it); nothing
    awaits between choosing a client and counting the calls on it.
    """

    def __init__(self, clients: Sequence[RouterClient]) -> None:
        if not clients:
            raise ValueError("RouterConnections needs at least one client")
        self.clients = tuple(clients)
        self._outstanding = [0] * len(self.clients)
        self._next = 0

    @classmethod
    def open(cls, cfg: GatewayConfig) -> RouterConnections:
        """`cfg.router_connections` clients to `cfg.router`, with its key and TLS. Channels
        connect on first use."""
        key, tls = cfg.router_api_key, cfg.router_tls
        credentials = tls.credentials() if tls else None
        metadata = [("authorization", f"Bearer {key}")] if key else []
        return cls([RouterClient(cfg.router, credentials, metadata=metadata,
                                 own_connection=True)
                    for _ in range(cfg.router_connections)])

    @property
    def first(self) -> RouterClient:
        """The client for calls that every front answers alike (model info, health, stats:
        the engine core's state, whichever front serves them)."""
        return self.clients[0]

    @property
    def outstanding(self) -> tuple[int, ...]:
        """Router calls in flight on each client, in client order."""
        return tuple(self._outstanding)

    @contextmanager
    def lease(self, calls: int = 1) -> Iterator[RouterClient]:
        """The client to run `calls` router calls on; they count as outstanding on it until
        the block exits (normally, by an error or cancelled)."""
        index = self._choose()
        self._outstanding[index] += calls
        try:
            yield self.clients[index]
        finally:
            self._outstanding[index] -= calls

    def _choose(self) -> int:
        count = len(self.clients)
        rotation = [(self._next + k) % count for k in range(count)]
        index = min(rotation, key=self._outstanding.__getitem__)  # the first of the least
        self._next = (index + 1) % count
        return index

    async def close(self) -> None:
        """Close every client's channel (cancels the calls still running on it)."""
        await asyncio.gather(*(client.close() for client in self.clients))
