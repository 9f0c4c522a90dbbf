"""Bearer-token admission for gRPC servers: a server interceptor that lets a call to the
protected service through only with metadata `authorization: Bearer <key>` (one of
`ApiKeys`, compared in constant time). Health and reflection stay open: probes and
discovery carry no key. Calls of every shape (unary, server-, client- and bidirectional
streaming) are refused the same way, with UNAUTHENTICATED and `message`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from foundation.api_keys import ApiKeys

__all__ = ["STAGE_TOKEN_ENV", "BearerInterceptor", "bearer_metadata"]

# The environment variable that carries a pipeline's pairing secret to its router and
# stages (`stagemesh serve` sets it for its children; on Kubernetes, a Secret).
STAGE_TOKEN_ENV = "STAGEMESH_STAGE_TOKEN"


def bearer_metadata(key: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents `key` (none for an empty key)."""
    return (("authorization", f"Bearer {key}"),) if key else ()


class BearerInterceptor(grpc.aio.ServerInterceptor):
    """Admits calls to methods under `protected_prefix` ("/package.Service/") only with a
    bearer key of `keys`; other methods pass."""

    def __init__(self, keys: ApiKeys, protected_prefix: str, message: str) -> None:
        self.keys = keys
        self.prefix = protected_prefix
        self.message = message

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        header = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        if self.keys.authorizes(header):
            return handler
        return self._refusal(handler)

    def _refusal(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        message = self.message

        async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def refuse_stream(_request: Any, context: grpc.aio.ServicerContext
                                ) -> AsyncIterator[Any]:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover  (makes this an async generator, as streaming is)

        kwargs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse_stream, **kwargs)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse_stream, **kwargs)
        return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
