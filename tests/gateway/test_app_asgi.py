"""The ASGI app over a scripted fake router, driven by raw ASGI messages: paths a real mesh
cannot produce on demand (a stage lost mid-stream) and the cancellation contract."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from gateway.app import GatewayApp, Running
from gateway.config import GatewayConfig
from gateway.connections import RouterConnections
from gateway.generate import GenerateHandler
from gateway.served import ModelViewLoader
from gateway.tokenize import TokenizeHandlers
from protos.stagemesh.v1 import inference_pb2 as pb
from router.client import Chunk

Script = list[Chunk | AioRpcError | str]  # "hang": wait forever (until cancelled)


class FakeRouter:
    """Plays `script` for every Generate call and records how each call ended."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[pb.GenerateRequest] = []
        self.ended: list[str] = []

    async def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(model="fake", context_length=64, vocab_size=10)

    async def generate(self, request: pb.GenerateRequest, timeout: float | None = None
                       ) -> AsyncIterator[Chunk]:
        self.requests.append(request)
        try:
            for item in self.script:
                if isinstance(item, AioRpcError):
                    raise item
                if item == "hang":
                    await asyncio.Event().wait()
                assert isinstance(item, Chunk)
                yield item
            self.ended.append("done")
        except (asyncio.CancelledError, GeneratorExit):
            self.ended.append("cancelled")  # RouterClient cancels the gRPC call here
            raise


def _app(fake: FakeRouter, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
         *more: FakeRouter) -> GatewayApp:
    """The app over `fake` (and `more`: one fake per router connection)."""
    monkeypatch.setenv("STAGEMESH_HOME", str(tmp_path))  # no tokenizer in this store
    cfg = GatewayConfig(router_connections=1 + len(more))
    app = GatewayApp(cfg)
    clients: list[Any] = [fake, *more]  # duck-type the RouterClient methods the gateway calls
    router = RouterConnections(clients)
    served = ModelViewLoader(router.first, cfg)
    app._running = Running(router, served, GenerateHandler(cfg, router, served, app.metrics),
                           TokenizeHandlers(router, served, cfg.max_body_bytes))
    return app


async def _call(app: GatewayApp, path: str, body: dict[str, Any] | bytes,
                disconnect_after: float | None = None) -> tuple[int | None, bytes]:
    """POST `body` (JSON-encoded, or these bytes as they are); the client disconnects after
    `disconnect_after` seconds if given."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw}
        if disconnect_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after or 0)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), None)
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] ==
                            "http.response.body")


def _events(raw: bytes) -> list[str]:
    return [e[len("data: "):] for e in raw.decode().split("\n\n") if e]


CHUNK = Chunk("r", 0, "Hello", (1,), None)


def test_router_failure_mid_stream_is_an_error_event_then_done(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lost = AioRpcError(grpc.StatusCode.UNAVAILABLE, Metadata(), Metadata(),
                       details="stage 1 down past the recovery budget")
    fake = FakeRouter([CHUNK, lost])
    status, raw = asyncio.run(_call(_app(fake, monkeypatch, tmp_path), "/v1/completions",
                                    {"prompt": "hi", "stream": True}))
    events = _events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"] == "Hello"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "unavailable" and "recovery budget" in error["message"]


def test_router_refusal_before_the_first_token_is_the_http_status(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    busy = AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, Metadata(),
                       Metadata(("retry-after", "2")), details="server busy")
    for stream in (False, True):
        fake = FakeRouter([busy])
        status, raw = asyncio.run(_call(_app(fake, monkeypatch, tmp_path), "/v1/completions",
                                        {"prompt": "hi", "stream": stream}))
        assert status == 429
        assert json.loads(raw)["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_cancels_every_router_call(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path, stream: bool) -> None:
    fake = FakeRouter([CHUNK, "hang"])
    app = _app(fake, monkeypatch, tmp_path)

    async def run() -> tuple[int | None, list[str]]:
        status, _ = await _call(app, "/v1/completions",
                                {"prompt": ["a", "b", "c"], "stream": stream},
                                disconnect_after=0.2)
        return status, list(fake.ended)  # before asyncio.run cancels any leftover task

    status, ended = asyncio.run(run())
    assert len(fake.requests) == 3
    assert ended == ["cancelled"] * 3
    assert status == (200 if stream else None)  # nothing was sent to a client that left
    assert app.metrics.registry.get_sample_value(
        "stagemesh_gateway_client_disconnects_total") == 1


def test_finished_calls_are_not_cancelled(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    fake = FakeRouter([Chunk("r", 0, "ok", (1,), "stop"),
                       Chunk("r", 0, "", (), None, (), {"prompt_tokens": 1,
                                                        "completion_tokens": 1})])
    status, raw = asyncio.run(_call(_app(fake, monkeypatch, tmp_path), "/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": "q"}]}))
    assert status == 200 and fake.ended == ["done"]
    body = json.loads(raw)
    assert body["model"] == "fake" and body["choices"][0]["message"]["content"] == "ok"
    assert body["usage"]["total_tokens"] == 2
