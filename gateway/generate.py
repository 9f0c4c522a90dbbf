"""POST /v1/completions and /v1/chat/completions: parse, call the router, answer.

Streamed or not, the router calls run inside `Exchange.unless_disconnected`: a client that
goes away cancels them, which aborts the requests and frees their KV blocks everywhere.
Errors the router reports before the first token become the HTTP status; later ones (a stage
down past the recovery budget) become an SSE `data: {"error": ...}` event before [DONE].
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from gateway.config import GatewayConfig
from gateway.connections import RouterConnections
from gateway.convert import ResponseBuilder, router_requests
from gateway.errors import APIError, from_rpc_error
from gateway.http import Exchange
from gateway.metrics import GatewayMetrics
from gateway.params import Endpoint, GenerationSpec, parse_chat, parse_completions
from gateway.served import ModelViewLoader
from gateway.streams import RouterStreams
from protos.stagemesh.v1 import inference_pb2 as pb

log = logging.getLogger("stagemesh.gateway")


def _renames(spec: GenerationSpec) -> dict[str, str]:
    """Router field names -> the names this endpoint's clients sent."""
    structured = {} if spec.structured_field is None else \
        {"structured_output": spec.structured_field}
    beam = spec.options.get("beam_search")
    if beam is not None:  # vLLM's names (the width is best_of, else n), with the others
        structured.update({
            "beam_search": "use_beam_search", "beam_search.length_penalty": "length_penalty",
            "beam_search.beam_width": "n" if beam["beam_width"] is None else "best_of"})
    if spec.endpoint is Endpoint.CHAT:
        return {"prompt": "messages", "input": "messages", "logprobs": "top_logprobs",
                "max_tokens": spec.max_tokens_field, **structured}
    return {"prompt_token_ids": "prompt", "input": "prompt", **structured}


def _as_api_error(exc: Exception, spec: GenerationSpec) -> APIError:
    if isinstance(exc, grpc.RpcError):
        return from_rpc_error(exc, _renames(spec))
    log.error("router call failed: %r", exc)
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # visible ASCII, no spaces


def request_id_header(ex: Exchange) -> str | None:
    """The client's X-Request-Id, checked (1-128 visible ASCII characters); None if absent."""
    value = ex.headers.get("x-request-id")
    if value is None:
        return None
    if not _REQUEST_ID.fullmatch(value):
        raise APIError(400, "X-Request-Id must be 1 to 128 visible ASCII characters "
                            f"(no spaces), got {value[:40]!r}", code="invalid_request_id")
    return value


class GenerateHandler:
    def __init__(self, cfg: GatewayConfig, router: RouterConnections, served: ModelViewLoader,
                 metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.router = router
        self.served = served
        self.metrics = metrics

    async def __call__(self, ex: Exchange, endpoint: Endpoint, route: str) -> None:
        started = time.monotonic()
        body = await ex.read_json(self.cfg.max_body_bytes)
        spec = (parse_chat(body) if endpoint is Endpoint.CHAT
                else parse_completions(body, self.cfg.max_prompts))
        try:
            view = await self.served.get()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        router_model = self.served.router_model(view, spec.model)
        prefix = "chatcmpl" if endpoint is Endpoint.CHAT else "cmpl"
        # The client's X-Request-Id names the request (in the response id, the router's
        # request ids, logs and traces), as vLLM does; it is echoed on the response.
        response_id = f"{prefix}-{request_id_header(ex) or uuid.uuid4().hex}"
        ex.response_headers.setdefault("x-request-id", response_id)
        log.info("%s %s: %d prompt(s), n=%d, stream=%s, user=%r", route, response_id,
                 len(spec.prompts), spec.n, spec.stream, spec.user)
        requests = router_requests(spec, router_model, response_id)
        echo = await self._echo_texts(spec) if spec.echo else ()
        builder = ResponseBuilder(spec, response_id, view.name, int(time.time()), view.texts,
                                  echo)
        run = self._stream if spec.stream else self._collect
        if await ex.unless_disconnected(run(ex, spec, requests, builder, route, started)):
            self.metrics.disconnects.inc()
            log.info("%s %s: client disconnected; router calls cancelled", route, response_id)
        u = builder.usage
        self.metrics.tokens.labels("prompt").inc(u["prompt_tokens"])
        self.metrics.tokens.labels("completion").inc(u["completion_tokens"])

    async def _echo_texts(self, spec: GenerationSpec) -> list[str]:
        """Each prompt's text for `echo`: as sent, or the router's decoding of its ids."""
        texts = []
        for prompt in spec.prompts:
            if prompt.text is not None:
                texts.append(prompt.text)
                continue
            try:
                texts.append(await self.router.first.detokenize(prompt.token_ids or ()))
            except grpc.RpcError as e:
                raise from_rpc_error(e, {"token_ids": "prompt"}) from e
        return texts

    @asynccontextmanager
    async def _router_streams(self, requests: list[pb.GenerateRequest]
                              ) -> AsyncIterator[RouterStreams]:
        """The request's router calls, all on the connection `RouterConnections` chooses."""
        with self.router.lease(len(requests)) as client:
            async with RouterStreams(client, requests, self.cfg.request_timeout_s) as streams:
                yield streams

    def _first_token(self, builder: ResponseBuilder, route: str, started: float) -> None:
        if not builder.choices:
            self.metrics.ttft.labels(route).observe(time.monotonic() - started)

    async def _collect(self, ex: Exchange, spec: GenerationSpec,
                       requests: list[pb.GenerateRequest], builder: ResponseBuilder,
                       route: str, started: float) -> None:
        async with self._router_streams(requests) as streams:
            try:
                async for prompt, chunk in streams:
                    self._first_token(builder, route, started)
                    builder.delta(prompt, chunk)
            except Exception as e:  # every failure becomes one HTTP error
                raise _as_api_error(e, spec) from e
        await ex.json(200, builder.response())

    async def _stream(self, ex: Exchange, spec: GenerationSpec,
                      requests: list[pb.GenerateRequest], builder: ResponseBuilder,
                      route: str, started: float) -> None:
        async with self._router_streams(requests) as streams:
            try:
                await streams.prime()
            except Exception as e:
                raise _as_api_error(e, spec) from e
            await ex.start_events()
            try:
                async for prompt, chunk in streams:
                    self._first_token(builder, route, started)
                    delta = builder.delta(prompt, chunk)
                    for event in builder.stream_chunks(delta) if delta is not None else ():
                        await ex.event(event)
            except Exception as e:  # headers are sent: report in the stream
                await ex.event(_as_api_error(e, spec).body())
            else:
                if spec.include_usage:
                    await ex.event(builder.usage_chunk())
            await ex.end_events()
