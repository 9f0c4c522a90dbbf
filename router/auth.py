"""API keys on the router's public API: a server interceptor that admits a call to
`stagemesh.v1.InferenceService` only with metadata `authorization: Bearer <key>`. Health and
reflection stay open (probes and discovery carry no key)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from foundation.api_keys import ApiKeys

PROTECTED_PREFIX = "/stagemesh.v1.InferenceService/"
MESSAGE = ("missing or incorrect API key: send gRPC metadata 'authorization: Bearer <key>'")


async def _refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)


async def _refuse_stream(_request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)
    yield  # pragma: no cover  (makes this an async generator, as a streaming handler is)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(PROTECTED_PREFIX):
            return handler
        metadata = dict(details.invocation_metadata or ())
        header = metadata.get("authorization", "")
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        if self.keys.authorizes(header):
            return handler
        kwargs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_refuse_stream, **kwargs)
        return grpc.unary_unary_rpc_method_handler(_refuse, **kwargs)
