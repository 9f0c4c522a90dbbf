"""The gateway's one error type, OpenAI's error body, and the one gRPC status -> HTTP mapping.

Every failure a client sees is an `APIError` rendered as
`{"error": {"message", "type", "param", "code"}}` with its HTTP status.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import grpc

# OpenAI's `type` values for each HTTP status the gateway returns.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "service_unavailable",
          504: "timeout_error"}

# gRPC status -> (HTTP status, OpenAI `code`). Anything else is a 500.
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_argument"),
    grpc.StatusCode.NOT_FOUND: (404, "model_not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "resource_exhausted"),
    grpc.StatusCode.UNAVAILABLE: (503, "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "deadline_exceeded"),
    grpc.StatusCode.CANCELLED: (503, "cancelled"),
}
DEFAULT_RETRY_AFTER_S = "1"

# Router INVALID_ARGUMENT messages start with the field they name ("max_tokens must be ...",
# "messages[2].role 'x' is not ...", "stop[0] is empty"); see router/validation.py.
_LEADING_FIELD = re.compile(r"^([a-z_]+)(?:\[\d+\])?(?:\.[a-z_]+(?:\[\d+\])?)*(?=[\s:]|$)")
_ROUTER_FIELDS = frozenset({
    "prompt", "prompt_token_ids", "messages", "input", "max_tokens", "temperature", "top_p",
    "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "logprobs", "n", "stop", "stop_token_ids", "priority", "request_id", "token_ids",
    "truncate_prompt_tokens", "min_tokens", "logit_bias", "ignore_eos", "structured_output",
    "tools", "tool_choice", "beam_search"})
# Router fields a client sends under one name of its own, whole: the router's sub-field
# ("structured_output.json_schema") is not part of the client's name ("response_format").
_WHOLE_RENAMES = frozenset({"structured_output"})


class APIError(Exception):
    """A request that ends with an HTTP error. `param` names the offending request field."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(param: str | None, message: str) -> APIError:
    """A 400 for a bad request field (`param`), with a message naming it and the limit."""
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def from_rpc_error(err: grpc.RpcError, rename: Mapping[str, str] | None = None) -> APIError:
    """The HTTP error for a failed router call: INVALID_ARGUMENT -> 400 (`param` = the field
    the router named, through `rename` into the client's vocabulary; a rename of the whole
    dotted name, "beam_search.beam_width", renames it in the message too), NOT_FOUND -> 404,
    RESOURCE_EXHAUSTED -> 429 with Retry-After (the router's `retry-after` trailer, else 1 s),
    UNAVAILABLE -> 503, DEADLINE_EXCEEDED -> 504; anything else -> 500."""
    code = err.code()
    details = err.details() or str(code)
    status, openai_code = _STATUS.get(code, (500, "internal_error"))
    if status == 500:
        return APIError(500, f"router error ({code.name}): {details}", code=openai_code)
    param = None
    if status == 400:
        match = _LEADING_FIELD.match(details)
        if match and match.group(1) in _ROUTER_FIELDS:
            base, full = match.group(1), match.group(0)
            renamed = (rename or {}).get(base)
            if full != base and full in (rename or {}):
                param = (rename or {})[full]
                details = param + details[len(full):]
            elif renamed is not None and base in _WHOLE_RENAMES:
                param = renamed
            else:
                param = (renamed or base) + match.group(0)[len(base):]
    elif status == 404:
        param = "model"
    headers = {}
    if status == 429:
        headers["Retry-After"] = _trailer(err, "retry-after") or DEFAULT_RETRY_AFTER_S
    elif status == 503:
        headers["Retry-After"] = DEFAULT_RETRY_AFTER_S
    return APIError(status, details, param=param, code=openai_code, headers=headers)


def _trailer(err: grpc.RpcError, key: str) -> str | None:
    trailing = getattr(err, "trailing_metadata", None)
    for k, v in (trailing() if callable(trailing) else None) or ():
        if k == key:
            return v if isinstance(v, str) else v.decode("ascii", "replace")
    return None
