"""The streams between the fronts and the engine core: one Unix-domain socket per front.

The core listens at its input path; each front connects (retrying while the core starts:
the two are started together) and says `Hello` first. Both directions then share the
stream, each message a 4-byte little-endian length and its msgspec bytes (`Codec`). Sends
never block: a send goes out at once or into the event loop's transport buffer, so the
core's step loop never waits on a front. When a front's stream closes the core stops
sending to it (the router still reports the front gone, `FrontGone`, which aborts its
sequences).

A message crosses one socket, read by the receiver's event loop itself: no broker thread
in either process (a front's receive measured 36-45 µs of CPU a message this way, against
98-105 through ZeroMQ's PUSH/PULL and its I/O threads; docs/BENCHMARKS.md, W6).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import cast

from router.core.messages import Codec, CoreMessage, FrontMessage, Hello

log = logging.getLogger("stagemesh.core")

_LENGTH = struct.Struct("<I")
# A message longer than this closes the stream (a peer that is not a front or core of this
# router, or a bug): the largest is an AddRequest, whose prompt the front bounded already.
MAX_MESSAGE_BYTES = 256 << 20
CONNECT_RETRY_S = 0.01  # a front's wait between tries while the core is not listening yet


class _Stream(asyncio.Protocol):
    """One end of a front's stream: splits what arrives into messages for `on_message`,
    frames what `write` is given."""

    def __init__(self, on_message: Callable[[bytes, _Stream], None],
                 on_lost: Callable[[_Stream], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's does not subclass asyncio.Transport).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # closed after a message past the limit: the rest is not framed
        buf = self._buf
        if not buf and len(data) >= _LENGTH.size:  # the common case: one whole message
            (n,) = _LENGTH.unpack_from(data)
            if n == len(data) - _LENGTH.size and n <= MAX_MESSAGE_BYTES:
                self._on_message(data[_LENGTH.size:], self)
                return
        buf += data
        start = 0
        while len(buf) - start >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(buf, start)
            if n > MAX_MESSAGE_BYTES:
                log.error("a channel peer sent a %d-byte message (limit %d); closing its "
                          "stream", n, MAX_MESSAGE_BYTES)
                buf.clear()
                self.close()
                return
            end = start + _LENGTH.size + n
            if end > len(buf):
                break
            self._on_message(bytes(buf[start + _LENGTH.size:end]), self)
            start = end
        del buf[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._on_lost(self)

    def write(self, data: bytes) -> None:
        """Queue one message; dropped once the stream is closed."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_LENGTH.pack(len(data)) + data)

    def close(self) -> None:
        """Close after what is queued has gone out."""
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close now; what is queued is dropped."""
        if self.transport is not None:
            self.transport.abort()


class _Inbox:
    """Messages in arrival order, with the stream each came on, for one awaiting reader."""

    def __init__(self) -> None:
        self._items: deque[tuple[bytes, _Stream]] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, data: bytes, stream: _Stream) -> None:
        self._items.append((data, stream))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> tuple[bytes, _Stream]:
        items = self._items
        while not items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return items.popleft()


def _ignore_lost(stream: _Stream) -> None:
    """A front's stream to the core closed: the core is gone, and the router's watch of it
    says so; what the front sends from now on is dropped."""


class CoreEndpoint:
    """The core's end: receive from every front, send to one. Listens from construction on
    (a front may connect before `receive` is first awaited); `start` serves the streams."""

    def __init__(self, input_address: str) -> None:
        self._codec = Codec()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(input_address)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._server: asyncio.AbstractServer | None = None
        self._inbox = _Inbox()
        self._fronts: dict[int, _Stream] = {}

    async def start(self) -> None:
        """Accept the fronts' streams on the running loop."""
        self._server = await asyncio.get_running_loop().create_unix_server(
            lambda: _Stream(self._inbox.put, self._lost), sock=self._listener)

    async def receive(self) -> FrontMessage:
        data, stream = await self._inbox.get()
        msg = self._codec.front_decoder.decode(data)
        if isinstance(msg, Hello):
            old = self._fronts.get(msg.front)
            if old is not None and old is not stream:
                old.close()
            self._fronts[msg.front] = stream
        return msg

    def _lost(self, stream: _Stream) -> None:
        for front, s in list(self._fronts.items()):
            if s is stream:
                del self._fronts[front]

    @property
    def fronts(self) -> list[int]:
        return list(self._fronts)

    def forget(self, front: int) -> None:
        """Stop sending to `front` (its process is gone); what is queued for it is dropped."""
        stream = self._fronts.pop(front, None)
        if stream is not None:
            stream.abort()

    def send(self, front: int, msg: CoreMessage) -> None:
        """Queue `msg` for `front` (dropped if that front never said hello, or is gone)."""
        stream = self._fronts.get(front)
        if stream is not None:
            stream.write(self._codec.encoder.encode(msg))

    def broadcast(self, msg: CoreMessage) -> None:
        data = self._codec.encoder.encode(msg)
        for stream in self._fronts.values():
            stream.write(data)

    def close(self) -> None:
        """Stop listening; each front's stream closes once what is queued for it is out."""
        if self._server is not None:
            self._server.close()
        else:
            self._listener.close()
        for stream in self._fronts.values():
            stream.close()


class FrontEndpoint:
    """A front's end: send to the core, receive what the core sends this front. Construct
    inside a running event loop: it connects in the background, retrying until the core
    listens; what is sent before that (the `Hello` first) waits and goes out in order."""

    def __init__(self, front: int, core_address: str) -> None:
        self._codec = Codec()
        self._inbox = _Inbox()
        self._stream = _Stream(self._inbox.put, _ignore_lost)
        self._pending: list[bytes] = []
        self._connecting = asyncio.get_running_loop().create_task(
            self._connect(core_address), name=f"front-{front}-connect")
        self.send(Hello(front))

    async def _connect(self, address: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await loop.create_unix_connection(lambda: self._stream, address)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(CONNECT_RETRY_S)
            except OSError as e:
                log.error("cannot connect to the engine core at %s: %s", address, e)
                raise
        pending, self._pending = self._pending, []
        for data in pending:
            self._stream.write(data)

    def send(self, msg: FrontMessage) -> None:
        data = self._codec.encoder.encode(msg)
        if self._connecting.done():
            self._stream.write(data)
        else:
            self._pending.append(data)

    async def receive(self) -> CoreMessage:
        data, _ = await self._inbox.get()
        return self._codec.core_decoder.decode(data)

    def close(self) -> None:
        self._connecting.cancel()
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._stream.close()
