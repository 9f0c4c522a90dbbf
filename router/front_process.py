"""A front process: `python -m router.front_process`, its `FrontConfig` as JSON on stdin
(never on the command line: it holds the TLS key and the API keys).

The router starts fronts 1..N-1 this way with `--api-processes N` (`router.fronts`). Each
serves the public gRPC API on the router's host:port (SO_REUSEPORT) as one more front of the
engine core. It writes one line on stdout: `ready` once it listens and the core has sent the
served model, or `error: <why>` when it cannot listen. SIGTERM or SIGINT drains it (readiness
NOT_SERVING, new requests UNAVAILABLE, in-flight ones get the drain timeout to finish); then
it exits 0. It exits at once if the router that started it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, TextIO

from foundation.tls import ListenError
from foundation.tokenizer import ModelTokenizer
from foundation.tracing import setup_tracing
from router.front_server import FrontConfig, FrontServer

log = logging.getLogger("stagemesh.router")

READY_LINE = "ready"
ERROR_PREFIX = "error: "


async def run_front(cfg: FrontConfig, report: TextIO) -> int:
    """The front's life: 0 after a drain, 1 when it could not listen or the core could not
    start (the router reports why)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = FrontServer(cfg, ModelTokenizer.from_dir(Path(cfg.model_dir)))
    watcher = asyncio.create_task(_exit_with_parent(cfg.front_id))
    try:
        try:
            await server.start()
        except ListenError as e:
            _say(report, f"{ERROR_PREFIX}{e}")
            return 1
        stopped = asyncio.create_task(stop.wait())
        waits: list[asyncio.Future[Any]] = [server.front.served, stopped]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        served = server.front.served
        if served.done() and served.exception() is not None:
            return 1  # the core could not start; the router says why
        if served.done():
            server.update_readiness()
            _say(report, READY_LINE)
        await stop.wait()
        log.info("front %d draining", cfg.front_id)
        await server.drain(loop.time() + cfg.drain_timeout_s)
        return 0
    finally:
        watcher.cancel()
        await server.stop()


def _say(report: TextIO, line: str) -> None:
    with contextlib.suppress(OSError):  # the router stopped reading: nothing to tell
        report.write(line + "\n")
        report.flush()


async def _exit_with_parent(front_id: int) -> None:
    """Exit when the router that started this process is gone."""
    parent = os.getppid()
    while True:
        await asyncio.sleep(1.0)
        if os.getppid() != parent:
            log.error("front %d: the router (pid %d) is gone; exiting", front_id, parent)
            os._exit(1)


def main() -> int:
    cfg = FrontConfig.from_json(sys.stdin.read())
    logging.basicConfig(level=logging.INFO, format=f"[front {cfg.front_id}] %(message)s",
                        stream=sys.stderr)
    setup_tracing("stagemesh-router", cfg.otlp_traces_endpoint)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    return asyncio.run(run_front(cfg, sys.stdout))


if __name__ == "__main__":
    sys.exit(main())
