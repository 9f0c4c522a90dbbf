"""The streams between the fronts and the engine core (`router.core.channel`), over real
Unix-domain sockets on one event loop: a front that connects before the core listens loses
nothing, each front gets only its own messages, in order, a large message arrives whole,
a front whose stream closed is no longer sent to, and a peer that announces a message past
the limit has its stream closed."""

from __future__ import annotations

import asyncio
import socket
import struct
from pathlib import Path

from router.core.channel import MAX_MESSAGE_BYTES, CoreEndpoint, FrontEndpoint
from router.core.messages import AddRequest, CoreState, Hello, Refused, Shutdown

TIMEOUT_S = 5.0


async def _receive(endpoint: CoreEndpoint | FrontEndpoint) -> object:
    return await asyncio.wait_for(endpoint.receive(), TIMEOUT_S)


def _add(front: int, n: int, prompt: list[int] | None = None) -> AddRequest:
    return AddRequest(f"r{front}-{n}", [front << 40 | n], prompt or [1, 2, 3], [], 0, 16, [])


def test_fronts_that_connect_first_each_get_their_own_messages_in_order(tmp_path: Path) -> None:
    async def body() -> None:
        path = str(tmp_path / "core.sock")
        fronts = [FrontEndpoint(i, path) for i in range(2)]  # before the core listens
        for i, front in enumerate(fronts):
            for n in range(3):
                front.send(_add(i, n))
        await asyncio.sleep(0.05)  # the fronts are retrying
        core = CoreEndpoint(path)
        await core.start()
        got: dict[int, list[object]] = {0: [], 1: []}
        for _ in range(8):
            msg = await _receive(core)
            front = msg.front if isinstance(msg, Hello) else msg.seq_ids[0] >> 40
            got[front].append(msg)
        for i in range(2):
            assert got[i][0] == Hello(i)
            assert [m.request_id for m in got[i][1:]] == [f"r{i}-{n}" for n in range(3)]
        assert sorted(core.fronts) == [0, 1]
        for i in range(2):
            for n in range(3):
                core.send(i, Refused([i << 40 | n], "resource_exhausted", f"{i}/{n}"))
        core.broadcast(CoreState(True))
        for i, front in enumerate(fronts):
            seen = [await _receive(front) for _ in range(4)]
            assert seen[:3] == [Refused([i << 40 | n], "resource_exhausted", f"{i}/{n}")
                                for n in range(3)]
            assert seen[3] == CoreState(True)
            front.close()
        core.close()

    asyncio.run(body())


def test_a_large_message_arrives_whole(tmp_path: Path) -> None:
    async def body() -> None:
        path = str(tmp_path / "core.sock")
        core = CoreEndpoint(path)
        await core.start()
        front = FrontEndpoint(7, path)
        prompt = list(range(1 << 20))  # several MB: many reads
        front.send(_add(7, 0, prompt))
        front.send(Shutdown())
        assert await _receive(core) == Hello(7)
        msg = await _receive(core)
        assert isinstance(msg, AddRequest) and msg.prompt == prompt
        assert await _receive(core) == Shutdown()
        front.close()
        core.close()

    asyncio.run(body())


def test_a_front_whose_stream_closed_is_not_sent_to(tmp_path: Path) -> None:
    async def body() -> None:
        path = str(tmp_path / "core.sock")
        core = CoreEndpoint(path)
        await core.start()
        front = FrontEndpoint(3, path)
        assert await _receive(core) == Hello(3)
        assert core.fronts == [3]
        front.close()
        for _ in range(100):
            if not core.fronts:
                break
            await asyncio.sleep(0.01)
        assert core.fronts == []
        core.send(3, CoreState(True))  # dropped, no error
        core.forget(3)
        core.close()

    asyncio.run(body())


def test_a_message_past_the_limit_closes_that_stream_only(tmp_path: Path) -> None:
    async def body() -> None:
        path = str(tmp_path / "core.sock")
        core = CoreEndpoint(path)
        await core.start()
        good = FrontEndpoint(1, path)
        assert await _receive(core) == Hello(1)
        loop = asyncio.get_running_loop()
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bad.setblocking(False)
        await loop.sock_connect(bad, path)
        await loop.sock_sendall(bad, struct.pack("<I", MAX_MESSAGE_BYTES + 1) + b"x" * 64)
        assert await asyncio.wait_for(loop.sock_recv(bad, 16), TIMEOUT_S) == b""  # closed
        bad.close()
        good.send(Shutdown())
        assert await _receive(core) == Shutdown()
        good.close()
        core.close()

    asyncio.run(body())
