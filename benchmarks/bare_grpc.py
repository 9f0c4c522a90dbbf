"""What the bare-gRPC benchmarks' child processes share: serve servicers on uvloop and
grpc.aio, as the router's front and the stages do, until the process is killed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc


def serve(register: Callable[[grpc.aio.Server], None], port: int, ready: Any,
          started: Callable[[], Awaitable[object]] | None = None) -> None:
    """In a child process: `register` adds its servicers to a server on 127.0.0.1:`port`
    (insecure); once it serves and `started()` (if given) returned, `ready` (a
    multiprocessing Event) is set. Runs until the process is killed."""
    import uvloop

    async def main() -> None:
        server = grpc.aio.server()
        register(server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        if started is not None:
            await started()
        ready.set()
        await server.wait_for_termination()

    uvloop.install()
    asyncio.run(main())
