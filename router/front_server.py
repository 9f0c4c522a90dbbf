"""One front and its public gRPC server: the InferenceService, gRPC health (`liveness`,
`readiness`) and reflection, the API-key interceptor and TLS as configured.

The router runs front 0 in its own process (`router.main`) and, with `--api-processes N`,
fronts 1..N-1 in front processes (`router.front_process`). Every front builds this same
server and binds the same host:port with SO_REUSEPORT, so the kernel spreads client
connections across them; every front is a front of the one engine core. A client's calls on
one connection all reach the same front; health, drain, GetModelInfo and GetStats answer the
same on each (the served model and the counters come from the core).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import msgspec
from grpc_health.v1 import health, health_pb2

from foundation.api_keys import ApiKeys
from foundation.byte_level import byte_level_tables
from foundation.metrics import use_multiprocess_dir
from foundation.tls import ServerTls, add_port, refuse_if_taken
from foundation.tokenizer import ModelTokenizer
from router.audit import AuditLog
from router.auth import api_key_interceptor
from router.config import RouterConfig
from router.core.channel import FrontEndpoint
from router.frontend import Frontend
from router.metrics import FrontMetrics
from router.outputs import FailureKind
from router.service import InferenceServicer, add_services
from router.tool_calls.parsers import resolve_format

log = logging.getLogger("stagemesh.router")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READINESS_POLL_S = 0.1
DRAIN_POLL_S = 0.05
MAX_STREAMS_PER_CONNECTION = 1024  # concurrent calls on one client connection


@dataclass(frozen=True)
class FrontConfig:
    """What one front needs; a front process gets it as JSON on stdin (it holds the TLS key
    and the API keys, which a command line would show to anyone on the host).

    Attributes:
        front_id: the front's id; its sequence ids are `front_id << 40 | n`. Never reused:
            a front process that is restarted gets a new id.
        core_address: the engine core's input socket (a Unix-domain socket path).
        port: the public port; for fronts 1..N-1 the one front 0 bound (the router's
            `--port`, or what the kernel gave front 0 for port 0).
        model_dir / model_name / host / max_request_bytes / stream_interval /
            drain_timeout_s / api_keys / tls / audit_log / audit_log_content: as
            `RouterConfig`.
        metrics_dir: the router's multi-process metrics directory ("" = no metrics).
        otlp_traces_endpoint: as `RouterConfig`; a front process sets up tracing with it.
        tool_call_parser: as `RouterConfig`.
    """

    front_id: int
    core_address: str
    model_dir: str
    model_name: str
    host: str
    port: int
    max_request_bytes: int = 4 << 20
    stream_interval: int = 1
    drain_timeout_s: float = 30.0
    api_keys: frozenset[str] = frozenset()
    tls: ServerTls | None = None
    audit_log: bool = True
    audit_log_content: bool = False
    metrics_dir: str = ""
    otlp_traces_endpoint: str | None = None
    tool_call_parser: str = "auto"

    @classmethod
    def of_router(cls, cfg: RouterConfig, front_id: int, core_address: str, port: int,
                  metrics_dir: str = "") -> FrontConfig:
        return cls(front_id, core_address, str(cfg.model_dir),
                   cfg.model_name, cfg.host, port, cfg.max_request_bytes, cfg.stream_interval,
                   cfg.drain_timeout_s, cfg.api_keys, cfg.tls, cfg.audit_log,
                   cfg.audit_log_content, metrics_dir, cfg.otlp_traces_endpoint,
                   cfg.tool_call_parser)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> FrontConfig:
        return msgspec.json.decode(text, type=cls)


class FrontServer:
    """A `Frontend` with its gRPC server. Construct inside a running event loop (the front
    says hello to the core at once; the core may listen a moment later)."""

    def __init__(self, cfg: FrontConfig, tokenizer: ModelTokenizer) -> None:
        self.cfg = cfg
        endpoint = FrontEndpoint(cfg.front_id, cfg.core_address)
        metrics = None
        if cfg.metrics_dir:
            use_multiprocess_dir(cfg.metrics_dir)
            metrics = FrontMetrics()
        self.front = Frontend(cfg.front_id, endpoint, tokenizer, cfg.stream_interval, metrics)
        byte_level_tables(tokenizer.tokenizer)  # the detokenizers' tables, before any request
        tool_parser = resolve_format(cfg.tool_call_parser, tokenizer.chat_template_text)
        if cfg.front_id == 0:
            log.info("tool calls: %s", f"parsed as {tool_parser.value}" if tool_parser
                     else "not parsed (--tool-call-parser; only tool_choice none is served)")
        self.servicer = InferenceServicer(self.front, tokenizer, cfg.model_name,
                                          AuditLog(cfg.audit_log, cfg.audit_log_content),
                                          tool_parser)
        self.health = health.HealthServicer()
        interceptors = [api_key_interceptor(ApiKeys(cfg.api_keys))] if cfg.api_keys else []
        # SO_REUSEPORT (gRPC's default on Linux, asked for here because the design relies on
        # it): every front binds the same host:port and the kernel spreads connections.
        # A stated stream limit per connection: past it a new call is refused by HTTP/2
        # (REFUSED_STREAM: UNAVAILABLE, safe to retry) where gRPC's own overload handling
        # would end it CANCELLED, which a client reads as its own doing.
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", cfg.max_request_bytes),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            ("grpc.so_reuseport", 1)])
        add_services(self.server, self.servicer, self.health)
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = False

    async def start(self) -> int:
        """Serve: health at once (readiness NOT_SERVING until the core reports the pipeline
        ready), the API (UNAVAILABLE until the core sent the served model). Returns the
        bound port. Raises ListenError."""
        self.set_health(ready=False)
        if self.cfg.front_id == 0:  # the first to bind: the port must be free, not shared
            refuse_if_taken(self.cfg.host, self.cfg.port)
        port = add_port(self.server, self.cfg.host, self.cfg.port, self.cfg.tls)
        self.front.corks.local_port = port
        await self.server.start()
        self._tasks = [
            asyncio.create_task(self.front.run(), name=f"front-{self.cfg.front_id}"),
            asyncio.create_task(self._watch_readiness(), name="readiness")]
        return port

    def set_health(self, ready: bool) -> None:
        self.health.set("liveness", SERVING)
        self.health.set("readiness", SERVING if ready else NOT_SERVING)
        self.health.set("", SERVING if ready else NOT_SERVING)

    def update_readiness(self) -> None:
        """Readiness from the core's state and the drain flag, now (the watcher does it
        every READINESS_POLL_S; a front that reports itself ready calls it first, so its
        health never says NOT_SERVING after it said it serves)."""
        ready = self.front.core_ready and not self.servicer.draining
        if ready != self._ready:
            self.set_health(ready)
            log.info("front %d readiness: %s", self.cfg.front_id,
                     "SERVING" if ready else "NOT_SERVING")
            self._ready = ready

    async def _watch_readiness(self) -> None:
        while True:
            self.update_readiness()
            await asyncio.sleep(READINESS_POLL_S)

    def start_draining(self) -> None:
        """Readiness NOT_SERVING at once; new requests get UNAVAILABLE."""
        self.servicer.draining = True
        self.update_readiness()

    async def drain(self, deadline: float, give_up: Callable[[], bool] = lambda: False) -> None:
        """Refuse new work and wait until the in-flight requests (beam searches included)
        finish, the loop time passes `deadline` or `give_up()` (the core is gone); then end
        the rest with UNAVAILABLE."""
        self.start_draining()
        loop = asyncio.get_running_loop()
        while (self.front.requests or self.servicer.beam_searches) \
                and loop.time() < deadline and not give_up():
            await asyncio.sleep(DRAIN_POLL_S)
        self.front.fail_all(FailureKind.UNAVAILABLE, "server stopping")

    async def stop(self) -> None:
        """Stop the server and close the front's sockets (after `drain`)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.server.stop(grace=1.0)
        self.servicer.validate.close()
        self.front.endpoint.close()
