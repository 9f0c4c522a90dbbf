"""The gateway's ASGI application: an explicit route allow-list, API keys, metrics, and the
small endpoints (health, readiness, metrics, models).

Every route is in `ROUTES`; any other path is 404 and any other method 405 (with Allow),
before authentication. With API keys configured every route but `OPEN_ROUTES` needs
`Authorization: Bearer <key>`; keys are compared in constant time (SHA-256 digests through
`hmac.compare_digest`, every key checked).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from foundation.api_keys import ApiKeys
from foundation.tracing import context_from_headers, tracer
from gateway.config import GatewayConfig
from gateway.connections import RouterConnections
from gateway.errors import APIError, from_rpc_error
from gateway.generate import GenerateHandler
from gateway.http import ClientDisconnectedError, Exchange, Receive, Send
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.params import Endpoint
from gateway.served import ModelView, ModelViewLoader
from gateway.tokenize import TokenizeHandlers, version

log = logging.getLogger("stagemesh.gateway")

Handler = Callable[[Exchange], Awaitable[None]]
OPEN_ROUTES = frozenset({"/health", "/ready", "/metrics", "/version"})
MODEL_PREFIX = "/v1/models/"
PROBE_TIMEOUT_S = 2.0
# Status recorded for a request whose client left before any response was sent (nginx's).
CLIENT_CLOSED = 499
# Metric labels take only these methods (anything else is "other": bounded cardinality).
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class Running:
    """What lives on the server's event loop, made at lifespan startup (a gRPC aio channel
    belongs to the loop that made it). Closed at lifespan shutdown."""

    router: RouterConnections
    served: ModelViewLoader
    generate: GenerateHandler
    tokens: TokenizeHandlers


class GatewayApp:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.metrics = GatewayMetrics()
        self._keys = ApiKeys(cfg.api_keys)
        self._running: Running | None = None
        self.routes: dict[str, dict[str, Handler]] = {
            "/health": {"GET": self._health},
            "/ready": {"GET": self._ready},
            "/metrics": {"GET": self._metrics},
            "/v1/models": {"GET": self._models},
            MODEL_PREFIX + "{model}": {"GET": self._model},
            "/v1/completions": {"POST": self._completions},
            "/v1/chat/completions": {"POST": self._chat},
            "/tokenize": {"POST": self._tokenize},
            "/detokenize": {"POST": self._detokenize},
            "/version": {"GET": self._version},
        }

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive,
                       send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(Exchange(scope, receive, send))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                router = RouterConnections.open(self.cfg)
                served = ModelViewLoader(router.first, self.cfg)
                self._running = Running(
                    router, served, GenerateHandler(self.cfg, router, served, self.metrics),
                    TokenizeHandlers(router, served, self.cfg.max_body_bytes))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._running is not None:
                    await self._running.router.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    @property
    def running(self) -> Running:
        if self._running is None:
            raise RuntimeError("the gateway's lifespan has not started (run it under uvicorn "
                               "with lifespan='on')")
        return self._running

    def _route(self, path: str) -> str | None:
        if path in self.routes:
            return path
        if path.startswith(MODEL_PREFIX) and len(path) > len(MODEL_PREFIX):
            return MODEL_PREFIX + "{model}"
        return None

    async def _http(self, ex: Exchange) -> None:
        """Answer one request; with tracing on, inside a server span that continues the
        client's trace (its `traceparent` header) and is the parent of the router calls.
        A client's X-Request-Id is echoed on every response (errors too)."""
        request_id = ex.headers.get("x-request-id")
        if request_id is not None and request_id.isprintable():
            ex.response_headers["x-request-id"] = request_id[:128]
        t = tracer()
        if t is None:
            await self._answer(ex)
            return
        route = self._route(ex.path) or "other"
        with t.start_as_current_span(
                f"{ex.method} {route}", context_from_headers(ex.headers), kind=SpanKind.SERVER,
                attributes={"http.request.method": ex.method, "http.route": route,
                            "url.path": ex.path}) as span:
            await self._answer(ex)
            status = ex.status or CLIENT_CLOSED
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))

    async def _answer(self, ex: Exchange) -> None:
        started = time.monotonic()
        route = self._route(ex.path)
        self.metrics.in_flight.inc()
        try:
            await self._dispatch(ex, route)
        except APIError as e:
            if not ex.started:
                await ex.error(e)
        except ClientDisconnectedError:
            pass
        except Exception:
            log.exception("unexpected error on %s %s", ex.method, ex.path)
            if not ex.started:
                await ex.error(APIError(500, "internal error", code="internal_error"))
        finally:
            self.metrics.in_flight.dec()
            label = route or "other"
            status = str(ex.status or CLIENT_CLOSED)
            method = ex.method if ex.method in _METHODS else "other"
            self.metrics.requests.labels(label, method, status).inc()
            self.metrics.duration.labels(label).observe(time.monotonic() - started)

    async def _dispatch(self, ex: Exchange, route: str | None) -> None:
        if route is None:
            raise APIError(404, f"no route {ex.path}", code="not_found")
        handler = self.routes[route].get(ex.method)
        if handler is None:
            allowed = ", ".join(self.routes[route])
            raise APIError(405, f"method {ex.method} is not allowed on {route}; use {allowed}",
                           code="method_not_allowed", headers={"Allow": allowed})
        if self._keys and route not in OPEN_ROUTES and not self._keys.authorizes(
                ex.headers.get("authorization", "")):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer "
                                "<key>'", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        await handler(ex)

    async def _health(self, ex: Exchange) -> None:
        """Liveness of the gateway process itself (the router has its own probes)."""
        await ex.json(200, {"status": "ok"})

    async def _ready(self, ex: Exchange) -> None:
        """Ready when the router's `readiness` health service says SERVING."""
        try:
            ready = await self.running.router.first.health("readiness", timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise APIError(503, f"router at {self.cfg.router} is not reachable: "
                                f"{e.code().name}", code="router_unreachable") from e
        if not ready:
            raise APIError(503, "router is not ready (NOT_SERVING)", code="router_not_ready")
        await ex.json(200, {"status": "ready"})

    async def _metrics(self, ex: Exchange) -> None:
        try:
            stats = await self.running.router.first.stats(timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError:
            stats = None
        await ex.respond(200, self.metrics.render(stats), CONTENT_TYPE)

    async def _models(self, ex: Exchange) -> None:
        view = await self._view()
        await ex.json(200, {"object": "list", "data": [view.card()]})

    async def _model(self, ex: Exchange) -> None:
        view = await self._view()
        name = ex.path[len(MODEL_PREFIX):]
        if name != view.name:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{view.name!r}", param="model", code="model_not_found")
        await ex.json(200, view.card())

    async def _view(self) -> ModelView:
        try:
            return await self.running.served.get()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    async def _completions(self, ex: Exchange) -> None:
        await self.running.generate(ex, Endpoint.COMPLETIONS, "/v1/completions")

    async def _chat(self, ex: Exchange) -> None:
        await self.running.generate(ex, Endpoint.CHAT, "/v1/chat/completions")

    async def _tokenize(self, ex: Exchange) -> None:
        await self.running.tokens.tokenize(ex)

    async def _detokenize(self, ex: Exchange) -> None:
        await self.running.tokens.detokenize(ex)

    async def _version(self, ex: Exchange) -> None:
        await ex.json(200, {"version": version()})
