"""The gateway process: the ASGI app under uvicorn (uvloop event loop, httptools parser).

Writes the bound "host:port" to the ready file (atomically) once the socket listens. The
router need not be up yet: /ready reports it, and requests get 503 until it answers.
SIGTERM/SIGINT: stop accepting, let open responses finish within the drain timeout, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import uvicorn

from foundation.tls import ListenError, refuse_if_taken
from foundation.tracing import setup_tracing
from gateway.app import GatewayApp
from gateway.config import GatewayConfig

log = logging.getLogger("stagemesh.gateway")


def _write_ready(path: Path, address: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(address)
    os.replace(tmp, path)


def _bound_address(server: uvicorn.Server) -> str:
    sock = server.servers[0].sockets[0]
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve_gateway(cfg: GatewayConfig, ready_file: Path | None = None) -> int:
    """Serve until SIGTERM/SIGINT. Raises ListenError when the port is taken (checked
    first: uvicorn's own bind failure ends its task with a SystemExit and a traceback)."""
    refuse_if_taken(cfg.host, cfg.port)
    config = uvicorn.Config(
        GatewayApp(cfg), host=cfg.host, port=cfg.port, loop="none", http="httptools",
        lifespan="on", access_log=False, log_level="warning",
        timeout_graceful_shutdown=int(cfg.drain_timeout_s), server_header=False)
    server = uvicorn.Server(config)
    # uvicorn drains on SIGTERM, then re-raises it under the handler found at start: a
    # no-op one makes a drained shutdown exit 0 instead of dying by the signal.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: None)
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            serving.result()  # raises the reason (e.g. the port is taken)
            return 1
        await asyncio.sleep(0.02)
    address = _bound_address(server)
    keys = f"{len(cfg.api_keys)} API key(s)" if cfg.api_keys else "no API keys"
    log.info("gateway listening on http://%s (router %s, %d connection(s), %s)", address,
             cfg.router, cfg.router_connections, keys)
    if ready_file is not None:
        _write_ready(ready_file, address)
    await serving
    return 0


def run_gateway(cfg: GatewayConfig, ready_file: Path | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[gateway] %(message)s", stream=sys.stderr)
    if setup_tracing("stagemesh-gateway", cfg.otlp_traces_endpoint) is not None:
        log.info("tracing: OpenTelemetry spans over OTLP")
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        try:
            return runner.run(serve_gateway(cfg, ready_file))
        except ListenError as e:
            log.error("%s", e)
            return 1
