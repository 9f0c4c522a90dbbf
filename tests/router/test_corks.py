"""`router.corks`: a front's client connections of several live streams are corked while a
core message's updates are written, and only those.

Over real sockets: the cork is read back from the kernel (`getsockopt(TCP_CORK)`) on the
socket that stands for gRPC's, so nothing here depends on timing. Over real gRPC: the peer
strings gRPC gives (IPv4, IPv6, IPv4-mapped) find the server's socket of that connection,
and through the router's real front, concurrent streams of one channel are corked and get
every token.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from router.corks import ConnectionCorks, find_connection, peer_address
from tests.default_model import default_model_dir
from tests.router.inprocess import in_process_mesh, stage_configs

pytestmark = pytest.mark.skipif(
    not hasattr(socket, "TCP_CORK") or not Path("/proc/self/fd").is_dir(),
    reason="TCP_CORK and /proc are Linux's")


def test_peer_strings() -> None:
    v4 = ipaddress.ip_address("127.0.0.1")
    assert peer_address("ipv4:127.0.0.1:5000") == (v4, 5000)
    assert peer_address("ipv6:[::1]:6000") == (ipaddress.ip_address("::1"), 6000)
    assert peer_address("ipv6:%5B::ffff:127.0.0.1%5D:7000") == (v4, 7000)  # mapped
    assert peer_address("unix:/tmp/socket") is None
    assert peer_address("ipv4:not-an-address:1") is None
    assert peer_address("ipv4:127.0.0.1:port") is None


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, socket.socket, str, int]]:
    """(the server's socket, standing for gRPC's; the client's; the client's peer string as
    gRPC writes it; the server's port)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    server, _ = listener.accept()
    listener.close()
    yield server, client, f"ipv4:127.0.0.1:{client.getsockname()[1]}", port
    server.close()
    client.close()


def _corked(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK)


async def _found(corks: ConnectionCorks, peer: str) -> None:
    """Until the look-up (on a worker thread) has found the peer's socket."""
    for _ in range(1000):
        entry = corks._peers.get(peer)
        if entry is not None and entry.sock is not None:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"no socket found for {peer}")


async def _passes(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_connection_of_two_streams_is_corked_for_one_pass(
        connection: tuple[socket.socket, socket.socket, str, int]) -> None:
    server, client, peer, port = connection

    async def run() -> None:
        corks = ConnectionCorks()
        corks.local_port = port
        seen: list[int] = []
        with corks.stream(peer):
            corks.cork()  # one stream: nothing to coalesce, not even looked for
            assert _corked(server) == 0
            corks.burst_written()
            with corks.stream(peer):
                await _found(corks, peer)
                corks.cork()
                assert _corked(server) == 1
                # the burst's handlers were woken before the uncork was queued
                asyncio.get_running_loop().call_soon(lambda: seen.append(_corked(server)))
                corks.burst_written()
                await _passes(2)
                assert seen == [1] and _corked(server) == 0
                server.sendall(b"update")
                assert client.recv(16) == b"update"

    asyncio.run(run())


def test_a_burst_noted_before_the_uncork_runs_is_written_corked(
        connection: tuple[socket.socket, socket.socket, str, int]) -> None:
    """Two core messages handled in one pass: the second burst's handlers, woken after the
    first uncork was queued, still write corked."""
    server, _, peer, port = connection

    async def run() -> None:
        corks = ConnectionCorks()
        corks.local_port = port
        loop = asyncio.get_running_loop()
        seen: list[int] = []
        with corks.stream(peer), corks.stream(peer):
            await _found(corks, peer)
            for _ in range(2):
                corks.cork()
                loop.call_soon(lambda: seen.append(_corked(server)))
                corks.burst_written()
            await _passes(4)
            assert seen == [1, 1] and _corked(server) == 0

    asyncio.run(run())


def test_the_duplicate_goes_with_the_last_stream(
        connection: tuple[socket.socket, socket.socket, str, int]) -> None:
    """After the peer's last stream, the corks hold no duplicate: gRPC closing its socket
    closes the connection (the client reads its end), also when a burst was corked."""
    server, client, peer, port = connection

    async def run() -> None:
        corks = ConnectionCorks()
        corks.local_port = port
        with corks.stream(peer), corks.stream(peer):
            await _found(corks, peer)
            corks.cork()
            assert _corked(server) == 1
        assert _corked(server) == 0  # uncorked with the last stream, before its close
        server.close()
        client.settimeout(5)
        assert client.recv(16) == b""

    asyncio.run(run())


def test_only_the_front_port_matches(
        connection: tuple[socket.socket, socket.socket, str, int]) -> None:
    server, client, _, port = connection
    client_port = client.getsockname()[1]
    peer = (ipaddress.ip_address("127.0.0.1"), client_port)
    found = find_connection(peer, port)
    assert found is not None and found.getsockname() == server.getsockname()
    found.close()
    assert find_connection(peer, port + 1 if port < 65535 else port - 1) is None
    assert find_connection((ipaddress.ip_address("127.0.0.1"), client_port + 1), port) is None


def _ipv6() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("bind, target", [
    ("127.0.0.1:0", "127.0.0.1"),
    pytest.param("[::1]:0", "[::1]", marks=pytest.mark.skipif(not _ipv6(), reason="no ::1")),
    pytest.param("[::]:0", "127.0.0.1", marks=pytest.mark.skipif(not _ipv6(),
                                                                  reason="no IPv6")),
])
def test_grpc_peer_strings_find_the_servers_socket(bind: str, target: str) -> None:
    """gRPC's own peer string of a call finds the server's socket of its connection, on an
    IPv4, an IPv6 and a dual-stack listener (an IPv4 client: an IPv4-mapped peer)."""

    async def run() -> None:
        found: list[tuple[object, ...]] = []

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            address = peer_address(context.peer())
            assert address is not None, context.peer()
            sock = find_connection(address, port)
            assert sock is not None, context.peer()
            found.append(sock.getpeername())
            sock.close()
            return request

        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {
            "Echo": grpc.unary_unary_rpc_method_handler(handle)})])
        port = server.add_insecure_port(bind)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"{target}:{port}") as channel:
                echo = channel.unary_unary("/t.T/Echo")
                assert await echo(b"x") == b"x"
        finally:
            await server.stop(None)
        assert len(found) == 1

    asyncio.run(run())


def test_the_routers_front_corks_a_channel_of_several_streams() -> None:
    """Through the router's front (null stages, in process): eight concurrent streams on one
    channel are corked in bursts once the look-up found their connection, every stream gets
    all its tokens, and the peer is forgotten once they end."""

    async def run() -> None:
        stages = stage_configs(default_model_dir(), 2, model_impl="null", num_blocks=512)
        async with in_process_mesh(stages, stream_interval=4) as mesh, \
                mesh.client() as client:
            corks = mesh.app.front.corks
            sets: list[int] = []
            set_cork = corks._set

            def counting(sock: socket.socket, on: int) -> bool:
                sets.append(on)
                return set_cork(sock, on)
            corks._set = counting  # type: ignore[method-assign]

            async def one(i: int) -> int:
                chunks = [c async for c in client.generate(
                    prompt=f"request {i}", max_tokens=96, ignore_eos=True)]
                return sum(len(c.token_ids) for c in chunks)
            assert await asyncio.gather(*(one(i) for i in range(8))) == [96] * 8
            assert sets.count(1) >= 1 and sets.count(1) == sets.count(0)
            assert corks._peers == {}

    asyncio.run(run())
