"""Concurrent router calls for one HTTP request, merged into one stream of chunks.

Contract: `close()` (or leaving `async with`) cancels every call still running, and a
cancelled call aborts its request on the router, which frees its KV blocks on every stage
(`RouterClient.generate` cancels the gRPC call when its consumer stops). This is how a client
disconnect reaches the router.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

from protos.stagemesh.v1 import inference_pb2 as pb
from router.client import Chunk, RouterClient

# Queue items: (prompt index, chunk) while a call streams; (prompt index, None) when it ends;
# (prompt index, error) when it fails.
_Item = tuple[int, Chunk | BaseException | None]


class RouterStreams:
    """One `Generate` call per request, run concurrently; chunks in arrival order."""

    def __init__(self, client: RouterClient, requests: Sequence[pb.GenerateRequest],
                 timeout: float | None) -> None:
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._pending: list[_Item] = []
        self._open = len(requests)
        self._tasks = [asyncio.create_task(self._pump(i, client, r, timeout))
                       for i, r in enumerate(requests)]

    async def _pump(self, index: int, client: RouterClient, request: pb.GenerateRequest,
                    timeout: float | None) -> None:
        try:
            async for chunk in client.generate(request=request, timeout=timeout):
                self._queue.put_nowait((index, chunk))
        except Exception as e:  # handed to the consumer, which maps it
            self._queue.put_nowait((index, e))
            return
        self._queue.put_nowait((index, None))

    async def prime(self) -> None:
        """Wait until every call has sent its first chunk or ended, so that an error the
        router reports up front (validation, admission, unknown model) can still become the
        HTTP status. Raises the first failed call's error (a `grpc.RpcError` from the
        router)."""
        seen: set[int] = set()
        while len(seen) < len(self._tasks):
            item = await self._queue.get()
            if isinstance(item[1], BaseException):
                raise item[1]
            seen.add(item[0])
            self._pending.append(item)

    async def __aiter__(self) -> AsyncIterator[tuple[int, Chunk]]:
        """(prompt index, chunk) until every call has ended; a failed call raises its
        error (the other calls are cancelled by `close`)."""
        while self._open:
            index, value = self._pending.pop(0) if self._pending else await self._queue.get()
            if value is None:
                self._open -= 1
            elif isinstance(value, BaseException):
                raise value
            else:
                yield index, value

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> RouterStreams:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()
