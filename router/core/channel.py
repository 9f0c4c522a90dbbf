"""The sockets between the fronts and the engine core (ZeroMQ over IPC).

The core binds one PULL socket that every front PUSHes to; each front binds its own PULL
socket for outputs and says where in its `Hello`, and the core PUSHes that front's messages
there (until `forget`: that front's process is gone). Sends never block (no high-water
mark): a send is a copy into ZeroMQ's queue, so the core's step loop never waits on a front.
Receives are asyncio, through `_Inbox`.
"""

from __future__ import annotations

import asyncio
from typing import cast

import zmq

from router.core.messages import Codec, CoreMessage, FrontMessage, Hello


def _push(ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.RECONNECT_IVL, 10)  # the peer may bind a moment later (start-up)
    sock.connect(address)
    return sock


class _Inbox:
    """A bound PULL socket read from the running event loop, without `zmq.asyncio` (whose
    futures, poller and flag enums cost a front more CPU than the message: it gets one a
    step). The loop watches the socket's FD, which ZeroMQ makes readable when the socket's
    events may have changed; `EVENTS` says whether a message is queued, and reading it
    re-arms the FD, so it is read before every wait."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.bind(address)
        self._fd = cast(int, self.sock.getsockopt(zmq.FD))

    async def recv(self) -> bytes:
        """The next message, waiting on the loop for one if none is queued."""
        sock = self.sock
        while not cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            await self._readable()
        return sock.recv(zmq.NOBLOCK)

    async def _readable(self) -> None:
        loop = asyncio.get_running_loop()
        woken = loop.create_future()
        loop.add_reader(self._fd, _wake, woken)
        try:
            await woken
        finally:
            loop.remove_reader(self._fd)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class CoreEndpoint:
    """The core's end: receive from every front, send to one."""

    def __init__(self, input_address: str) -> None:
        self._codec = Codec()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pull = _Inbox(self._ctx, input_address)
        self._fronts: dict[int, zmq.Socket[bytes]] = {}

    async def receive(self) -> FrontMessage:
        data = await self._pull.recv()
        msg = self._codec.front_decoder.decode(data)
        if isinstance(msg, Hello):
            self._connect(msg)
        return msg

    def _connect(self, hello: Hello) -> None:
        old = self._fronts.pop(hello.front, None)
        if old is not None:
            old.close()
        self._fronts[hello.front] = _push(self._ctx, hello.address)

    @property
    def fronts(self) -> list[int]:
        return list(self._fronts)

    def forget(self, front: int) -> None:
        """Stop sending to `front` (its process is gone); what is queued for it is dropped."""
        sock = self._fronts.pop(front, None)
        if sock is not None:
            sock.close(linger=0)

    def send(self, front: int, msg: CoreMessage) -> None:
        """Queue `msg` for `front` (dropped if that front never said hello)."""
        sock = self._fronts.get(front)
        if sock is not None:
            sock.send(self._codec.encoder.encode(msg))

    def broadcast(self, msg: CoreMessage) -> None:
        data = self._codec.encoder.encode(msg)
        for sock in self._fronts.values():
            sock.send(data)

    def close(self) -> None:
        for sock in self._fronts.values():
            sock.close()
        self._pull.sock.close(linger=0)
        self._ctx.term()


class FrontEndpoint:
    """A front's end: send to the core, receive what the core sends this front."""

    def __init__(self, front: int, core_address: str, output_address: str) -> None:
        self._codec = Codec()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pull = _Inbox(self._ctx, output_address)
        self._push = _push(self._ctx, core_address)
        self.send(Hello(front, output_address))

    def send(self, msg: FrontMessage) -> None:
        self._push.send(self._codec.encoder.encode(msg))

    async def receive(self) -> CoreMessage:
        return self._codec.core_decoder.decode(await self._pull.recv())

    def close(self) -> None:
        self._push.close()
        self._pull.sock.close(linger=0)
        self._ctx.term()
