"""The router's error types and their one mapping to gRPC status codes."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from foundation.tokenizer import ChatTemplateError
from router.outputs import FailureKind, RequestFailed
from router.scheduler import AdmissionRefusedError, InvalidRequestError
from router.validation import ValidationError

log = logging.getLogger("stagemesh.router")

RETRY_AFTER_S = 1


class ModelNotFoundError(LookupError):
    """A request named a model this router does not serve (NOT_FOUND, HTTP 404)."""


class RequestNotFoundError(LookupError):
    """An Abort named a request_id no running request has (NOT_FOUND, HTTP 404)."""


class UnavailableError(RuntimeError):
    """Draining, starting, or the pipeline is down past its recovery budget (UNAVAILABLE,
    HTTP 503)."""


class QueueFullError(RuntimeError):
    """The engine core's queue is at a limit; retry later (RESOURCE_EXHAUSTED, HTTP 429)."""


class DuplicateRequestError(ValueError):
    """A request_id equal to that of a live request (ALREADY_EXISTS, HTTP 409)."""


def failure_error(failed: RequestFailed) -> Exception:
    """The exception a request's failure item stands for (mapped by `status_for`)."""
    if failed.kind is FailureKind.RESOURCE_EXHAUSTED:
        return QueueFullError(failed.message)
    if failed.kind is FailureKind.INVALID_ARGUMENT:
        return InvalidRequestError(failed.message)
    if failed.kind is FailureKind.ALREADY_EXISTS:
        return DuplicateRequestError(failed.message)
    if failed.kind is FailureKind.UNAVAILABLE:
        return UnavailableError(failed.message)
    return RuntimeError(failed.message)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status and message a client sees for `exc`; None for an unexpected error."""
    if isinstance(exc, ValidationError | InvalidRequestError | ChatTemplateError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, ModelNotFoundError | RequestNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, DuplicateRequestError):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, AdmissionRefusedError | QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, UnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    return None


async def abort_with_status(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """End the call with `exc`'s status (see `status_for`); INTERNAL for the unexpected."""
    mapped = status_for(exc)
    if mapped is None:
        log.exception("unexpected error in a handler")
        mapped = (grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
    if mapped[0] is grpc.StatusCode.RESOURCE_EXHAUSTED:
        context.set_trailing_metadata((("retry-after", str(RETRY_AFTER_S)),))
    await context.abort(mapped[0], mapped[1])


R = TypeVar("R")


def unary_errors(fn: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Map a unary handler's exceptions to statuses (see `status_for`)."""
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await abort_with_status(context, e)
            raise AssertionError("unreachable") from e
    return wrapper
