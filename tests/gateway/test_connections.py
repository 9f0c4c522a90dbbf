"""`RouterConnections` and `--router-connections`: which client a request's router calls go
on, the lifespan that opens and closes the clients, and the flag from `stagemesh gateway`
and `stagemesh serve` to the config."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.app import GatewayApp
from gateway.config import GatewayConfig
from gateway.connections import RouterConnections
from router.client import RouterClient
from stagemesh.cli import build_parser
from stagemesh.cli_gateway import gateway_config
from stagemesh.launcher import build_children
from tests.default_model import default_model_dir
from tests.gateway.test_app_asgi import CHUNK, FakeRouter, _app, _call


def _connections(count: int) -> tuple[RouterConnections, list[Any]]:
    clients: list[Any] = [f"client {i}" for i in range(count)]  # only handed back
    return RouterConnections(clients), clients


def test_idle_leases_rotate_over_the_clients() -> None:
    router, clients = _connections(3)
    chosen = []
    for _ in range(7):
        with router.lease() as client:
            chosen.append(client)
    assert chosen == [*clients, *clients, clients[0]]
    assert router.first == clients[0] and router.outstanding == (0, 0, 0)


def test_a_lease_goes_to_the_client_with_fewest_calls_in_flight() -> None:
    router, (a, b, c) = _connections(3)
    with router.lease(2) as first, router.lease() as second, router.lease() as third:
        assert (first, second, third) == (a, b, c) and router.outstanding == (2, 1, 1)
        with router.lease() as fourth:  # b and c tie: b comes first in the rotation
            assert fourth == b and router.outstanding == (2, 2, 1)
        with router.lease() as fifth:  # the rotation goes on after b
            assert fifth == c and router.outstanding == (2, 1, 2)
        with router.lease(3) as sixth:  # the rotation is back at a (2); b is the least
            assert sixth == b and router.outstanding == (2, 4, 1)
    assert router.outstanding == (0, 0, 0)


def test_a_lease_ends_when_its_block_fails() -> None:
    router, _ = _connections(2)
    with pytest.raises(RuntimeError), router.lease(4):
        raise RuntimeError("the router call failed")
    assert router.outstanding == (0, 0)
    with pytest.raises(ValueError):
        RouterConnections([])


def test_http_requests_rotate_over_the_router_clients(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """Sequential requests through the app: each goes on the next client, all its prompts
    on that one; model info comes from the first."""
    fakes = [FakeRouter([CHUNK]) for _ in range(3)]
    app = _app(fakes[0], monkeypatch, tmp_path, *fakes[1:])

    async def run() -> list[int]:
        got = []
        for prompts in (["a"], ["b", "c"], ["d"], ["e"]):
            counts = [len(f.requests) for f in fakes]
            status, _ = await _call(app, "/v1/completions", {"prompt": prompts})
            assert status == 200
            grew = [i for i, f in enumerate(fakes) if len(f.requests) != counts[i]]
            assert len(grew) == 1
            got.append(grew[0])
        return got

    assert asyncio.run(run()) == [0, 1, 2, 0]
    assert [[r.text for r in f.requests] for f in fakes] == [["a", "e"], ["b", "c"], ["d"]]
    assert app.running.router.outstanding == (0, 0, 0)


def test_lifespan_opens_one_channel_per_connection_and_closes_them_all() -> None:
    app = GatewayApp(GatewayConfig(router="127.0.0.1:1", router_connections=3))

    async def run() -> list[RouterClient]:
        queue: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        for kind in ("startup", "shutdown"):
            queue.put_nowait({"type": f"lifespan.{kind}"})
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "lifespan.startup.complete":
                clients.extend(app.running.router.clients)
                assert all(c.channel.get_state() == grpc.ChannelConnectivity.IDLE
                           for c in clients)

        clients: list[RouterClient] = []
        await app({"type": "lifespan"}, queue.get, send)
        assert [m["type"] for m in sent] == ["lifespan.startup.complete",
                                             "lifespan.shutdown.complete"]
        return clients

    clients = asyncio.run(run())
    assert len({id(c.channel) for c in clients}) == 3
    assert all(c.channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN for c in clients)


def test_the_flag_reaches_the_config_and_serve_passes_its_api_processes(
        tmp_path: Path) -> None:
    parser = build_parser()
    assert gateway_config(parser.parse_args(["gateway"])).router_connections == 1
    flagged = parser.parse_args(["gateway", "--router-connections", "3"])
    assert gateway_config(flagged).router_connections == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["gateway", "--router-connections", "0"])
    with pytest.raises(ValueError):
        GatewayConfig(router_connections=0)
    for processes in ("1", "4"):
        serve = parser.parse_args(["serve", "--model", str(default_model_dir()), "--device",
                                   "cpu", "--api-processes", processes])
        gateway = next(c for c in build_children(serve, tmp_path) if c.role == "gateway")
        assert gateway.argv[3] == "gateway"
        assert gateway_config(parser.parse_args(gateway.argv[3:])).router_connections == int(
            processes)
