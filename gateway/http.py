"""One HTTP exchange over ASGI: a bounded body read, JSON and SSE responses, and running
work that a client disconnect cancels.

The ASGI server (uvicorn) answers `receive()` with `http.disconnect` once the client has gone;
after the body is read nothing else arrives, so a task blocked on `receive()` is a disconnect
watcher.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gateway.errors import APIError, invalid

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_SSE_HEADERS = {"content-type": "text/event-stream; charset=utf-8",
                "cache-control": "no-cache", "x-accel-buffering": "no"}


class ClientDisconnectedError(Exception):
    """The client went away before its request was read; nothing is sent back."""


def dump_json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class Exchange:
    """The request's method, path and headers, and the means to answer it once."""

    def __init__(self, scope: Mapping[str, Any], receive: Receive, send: Send) -> None:
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                        for k, v in scope.get("headers", ())}
        self._receive = receive
        self._send = send
        self.status: int | None = None  # set when the response starts
        self.response_headers: dict[str, str] = {}  # added to whatever response is sent

    @property
    def started(self) -> bool:
        return self.status is not None

    async def read_body(self, limit: int) -> bytes:
        """The whole body; 413 as soon as it is known to exceed `limit` bytes."""
        declared = self.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size, more = [], 0, True
        while more:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnectedError("client disconnected while sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    async def read_json(self, limit: int) -> dict[str, Any]:
        """The body as a JSON object: strict UTF-8, no NaN/Infinity, an object at the top."""
        body = await self.read_body(limit)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise invalid(None, f"the request body is not valid UTF-8 (byte {e.start})") from e
        try:
            value = json.loads(text, parse_constant=_reject_constant)
        except ValueError as e:
            raise invalid(None, f"the request body is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise invalid(None, "the request body must be a JSON object, got "
                                f"{type(value).__name__ if value is not None else 'null'}")
        return value

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        self.status = status
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1"))
               for k, v in {**headers, **self.response_headers}.items()]
        await self._send({"type": "http.response.start", "status": status, "headers": raw})

    async def body(self, data: bytes, more: bool = False) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def respond(self, status: int, data: bytes, content_type: str,
                      headers: Mapping[str, str] | None = None) -> None:
        await self.start(status, {"content-type": content_type,
                                  "content-length": str(len(data)), **(headers or {})})
        await self.body(data)

    async def json(self, status: int, obj: Any, headers: Mapping[str, str] | None = None
                   ) -> None:
        await self.respond(status, dump_json(obj), "application/json", headers)

    async def error(self, err: APIError) -> None:
        await self.json(err.status, err.body(), err.headers)

    async def start_events(self) -> None:
        await self.start(200, _SSE_HEADERS)

    async def event(self, obj: Any) -> None:
        """One server-sent event: `data: <json>` (or `data: [DONE]` for the string)."""
        data = obj.encode() if isinstance(obj, str) else dump_json(obj)
        await self.body(b"data: " + data + b"\n\n", more=True)

    async def end_events(self) -> None:
        await self.event("[DONE]")
        await self.body(b"")

    async def unless_disconnected(self, work: Awaitable[None]) -> bool:
        """Run `work`; if the client disconnects first, cancel it and return True.
        Call only after the body has been read (the watcher consumes `receive`)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.create_task(self._wait_disconnect())
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return True
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        task.result()  # re-raise what the work raised
        return False

    async def _wait_disconnect(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body is {size} bytes or more; at most {limit} bytes "
                         "are accepted", code="request_too_large")
