"""A front's client connections, corked while one core message's updates are written.

gRPC writes every message of a server stream at once, in a TCP segment of its own: the
front's `context.write` starts a batch, and the transport, idle, sends it before returning.
A core message ends with a burst of updates (at W6's stream interval 16, about 14 for each
message, one message per ~7 steps), and a client that multiplexes its streams on one
connection (every gRPC channel does; so does the gateway) is then woken once for each of
them. Corking the connection (Linux's TCP_CORK, what nginx's `tcp_nopush` sets) for the
event-loop pass in which the burst's stream handlers write, and uncorking it after, sends
the burst in as few segments as its size allows, and the client reads it in one wake-up.

The cost is the pass: the first update of a burst leaves when the last one is written,
about 20 µs later for each update written after it (W6's VM). Only a connection with two
or more live streams is corked (one stream has nothing to coalesce with), so a client of
one stream at a time is never looked for and never delayed.

How a connection is found: gRPC does not expose its sockets. A stream gives its peer's
address (`context.peer()`); the first time a peer has two live streams, this process's
descriptors (`/proc/self/fd`) are searched, on a worker thread, for the TCP socket connected
to that address on the front's port, and a duplicate of it is kept while the peer has live
streams. The duplicate is closed when the peer's last stream ends: holding it longer would
keep the connection open after gRPC closed it. Where TCP_CORK or `/proc` is missing, or no socket
matches (a Unix-domain peer), nothing is corked.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import unquote

log = logging.getLogger("stagemesh.router")

_TCP_CORK: int | None = getattr(socket, "TCP_CORK", None)
_FD_DIR = "/proc/self/fd"
Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


def peer_address(peer: str) -> Address | None:
    """The (ip, port) of a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", maybe
    percent-encoded); an IPv4-mapped IPv6 address as its IPv4 address. None for any other
    kind of peer (a Unix-domain socket's)."""
    kind, _, rest = unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    try:
        return _normal(ipaddress.ip_address(host.strip("[]"))), int(port)
    except ValueError:
        return None


def _normal(ip: ipaddress.IPv4Address | ipaddress.IPv6Address
            ) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return mapped if mapped is not None else ip


def _socket_address(sock_address: tuple[object, ...]) -> Address | None:
    try:
        return _normal(ipaddress.ip_address(str(sock_address[0]).split("%")[0])), \
            int(str(sock_address[1]))
    except (ValueError, IndexError):
        return None


def find_connection(peer: Address, local_port: int) -> socket.socket | None:
    """A duplicate of this process's TCP socket connected to `peer` whose local port is
    `local_port` (0: any), or None. Costs 5-15 µs for each descriptor the process has (W6's
VM), so the front runs it on a worker thread; a descriptor closed or reused meanwhile is
skipped or read for what it is then."""
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return None
    for name in names:
        try:
            if not os.readlink(f"{_FD_DIR}/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue
        try:
            if (sock.type == socket.SOCK_STREAM
                    and sock.family in (socket.AF_INET, socket.AF_INET6)
                    and (not local_port or sock.getsockname()[1] == local_port)
                    and _socket_address(sock.getpeername()) == peer):
                return sock
        except OSError:
            pass
        sock.close()
    return None


@dataclass
class _Peer:
    streams: int = 0
    sock: socket.socket | None = None
    looked: bool = False  # looked for its socket while it had live streams


class ConnectionCorks:
    """The front's live streams by peer and the sockets of the peers with two or more.
    Single event loop (the front's).

    `local_port`: the front's bound port, set once the server is bound (0: connections on
    any local port match a peer)."""

    def __init__(self) -> None:
        self.enabled = _TCP_CORK is not None and os.path.isdir(_FD_DIR)
        self.local_port = 0
        self._peers: dict[str, _Peer] = {}
        self._found: list[_Peer] = []  # the peers whose socket was found: the ones to cork
        self._corked: list[socket.socket] = []
        self._bursts = 0  # bursts noted; the uncork runs after the last one's writes
        self._uncork_due = False

    @contextlib.contextmanager
    def stream(self, peer: str) -> Iterator[None]:
        """Count a live stream of `peer` (a gRPC `context.peer()`) for the block's length."""
        if not self.enabled:
            yield
            return
        entry = self._peers.get(peer)
        if entry is None:
            entry = self._peers[peer] = _Peer()
        entry.streams += 1
        if entry.streams == 2 and not entry.looked:
            entry.looked = True
            address = peer_address(peer)
            if address is not None:
                self._look_up(peer, entry, address)
        try:
            yield
        finally:
            entry.streams -= 1
            if entry.streams == 0:
                del self._peers[peer]
                if entry.sock is not None:
                    self._found.remove(entry)
                    if entry.sock in self._corked:
                        self._set(entry.sock, 0)
                        self._corked.remove(entry.sock)
                    entry.sock.close()

    def _look_up(self, peer: str, entry: _Peer, address: Address) -> None:
        """Find the peer's socket on a worker thread (the search reads every descriptor of
        the process: milliseconds for hundreds of connections, which the event loop does not
        wait for); its streams are corked from the next burst on, if any is still live."""
        def found(future: asyncio.Future[socket.socket | None]) -> None:
            sock = None if future.cancelled() or future.exception() else future.result()
            if sock is None:
                log.debug("no TCP socket found for peer %s: its streams stay uncorked", peer)
            elif self._peers.get(peer) is not entry:  # its streams ended meanwhile
                sock.close()
            else:
                entry.sock = sock
                self._found.append(entry)
        asyncio.get_running_loop().run_in_executor(
            None, find_connection, address, self.local_port).add_done_callback(found)

    def cork(self) -> None:
        """Cork every connection of two or more live streams until `burst_written`'s uncork
        runs. Call before queueing a burst of updates."""
        if not self.enabled or self._corked:
            return
        for entry in self._found:
            if entry.streams > 1 and entry.sock is not None and self._set(entry.sock, 1):
                self._corked.append(entry.sock)

    def burst_written(self) -> None:
        """The burst's updates are queued and their streams' handlers woken: uncork once
        the loop has run them (and the handlers of any burst noted before then)."""
        if not self._corked:
            return
        self._bursts += 1
        if not self._uncork_due:
            self._uncork_due = True
            asyncio.get_running_loop().call_soon(self._uncork, self._bursts)

    def _uncork(self, bursts: int) -> None:
        if bursts != self._bursts:  # another burst's handlers were woken after this was
            asyncio.get_running_loop().call_soon(self._uncork, self._bursts)  # queued
            return
        self._uncork_due = False
        for sock in self._corked:
            self._set(sock, 0)
        self._corked.clear()

    @staticmethod
    def _set(sock: socket.socket, on: int) -> bool:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK or 0, on)
        except OSError:  # the connection is gone; its streams end on their own
            return False
        return True
