"""A Python client for the router's public API (tests, benchmarks and the gateway use it).

    async with RouterClient("127.0.0.1:50051") as client:
        async for chunk in client.generate(prompt="Hello", max_tokens=16):
            print(chunk.text, end="")
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from foundation.tracing import current_metadata, tracer
from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc
from router.client_tools import (
    ToolCallPiece,
    message_to_proto,
    tool_call_pieces,
    tool_choice_to_proto,
    tools_to_proto,
)

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "min_tokens", "logit_bias",
                    "structured_output")


@dataclass(frozen=True)
class Chunk:
    """One streamed update. `usage` is set on the last chunk of a call (empty choice);
    `prompt_tokens` on the first (0 on the others)."""

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    logprobs: tuple[tuple[int, float, tuple[tuple[int, float], ...]], ...] = ()
    usage: dict[str, int] | None = None
    prompt_tokens: int = 0
    stop_reason: str | int | None = None  # see GenerateResponse.stop_reason
    # On the first chunk, with prompt_logprobs asked: entry i scores prompt token i + 1, as
    # (token id, logprob, top alternatives) like `logprobs`.
    prompt_logprobs: tuple[tuple[int, float, tuple[tuple[int, float], ...]], ...] = ()
    # Tool-call pieces parsed from the output, (index, id, name, arguments): a call's first
    # piece has its id and name, later ones argument text (GenerateResponse.tool_calls).
    tool_calls: tuple[ToolCallPiece, ...] = ()
    beam_score: float | None = None  # see GenerateResponse.beam_score
    prompt_token_ids: tuple[int, ...] = ()  # on the first chunk, with prompt_logprobs asked


@dataclass
class Completion:
    """A whole generation, collected from the stream."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    usage: dict[str, int] | None = None


def build_request(prompt: str | None = None, *, messages: Sequence[dict[str, Any]] | None = None,
                  token_ids: Sequence[int] | None = None, model: str = "",
                  max_tokens: int | None = None, stop: Sequence[str] = (),
                  stop_token_ids: Sequence[int] = (), n: int | None = None,
                  logprobs: int | None = None, ignore_eos: bool = False,
                  request_id: str = "", priority: int = 0,
                  include_stop_str_in_output: bool = False,
                  skip_special_tokens: bool | None = None,
                  truncate_prompt_tokens: int | None = None,
                  prompt_logprobs: int | None = None,
                  tools: Sequence[dict[str, Any]] | None = None,
                  tool_choice: str | dict[str, Any] | None = None,
                  parallel_tool_calls: bool | None = None,
                  beam_search: dict[str, Any] | None = None,
                  **sampling: Any) -> pb.GenerateRequest:
    """A GenerateRequest from keyword arguments; sampling keys as in `SamplingParams`;
    messages, tools and tool_choice in OpenAI's shapes (`router.client_tools`); beam_search
    as {"beam_width", "length_penalty", "early_stopping": False | True | "never"}, unset
    keys or None values left to the router."""
    unknown = set(sampling) - set(_SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling argument(s): {', '.join(sorted(unknown))}")
    req = pb.GenerateRequest(model=model, stop=list(stop), stop_token_ids=list(stop_token_ids),
                             ignore_eos=ignore_eos, request_id=request_id, priority=priority,
                             include_stop_str_in_output=include_stop_str_in_output)
    if prompt is not None:
        req.text = prompt
    elif messages is not None:
        req.chat.messages.extend(message_to_proto(m) for m in messages)
        req.chat.tools.extend(tools_to_proto(tools or ()))
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    for key, value in sampling.items():
        if key == "logit_bias":
            req.sampling.logit_bias.update(value or {})
        elif key == "structured_output":
            if value is not None:
                set_structured_output(req.sampling.structured_output, *value)
        elif value is not None:
            setattr(req.sampling, key, value)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    if n is not None:
        req.n = n
    if logprobs is not None:
        req.logprobs = logprobs
    if skip_special_tokens is not None:
        req.skip_special_tokens = skip_special_tokens
    if truncate_prompt_tokens is not None:
        req.truncate_prompt_tokens = truncate_prompt_tokens
    if tool_choice is not None:
        req.tool_choice.CopyFrom(tool_choice_to_proto(tool_choice))
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = parallel_tool_calls
    if prompt_logprobs is not None:
        req.prompt_logprobs = prompt_logprobs
    if beam_search is not None:
        set_beam_search(req.beam_search, **beam_search)
    return req


_EARLY_STOPPING = {None: pb.BEAM_EARLY_STOPPING_UNSPECIFIED,
                   False: pb.BEAM_EARLY_STOPPING_UNSPECIFIED,
                   True: pb.BEAM_EARLY_STOPPING_FINISHED, "never": pb.BEAM_EARLY_STOPPING_NEVER}


def set_beam_search(msg: pb.BeamSearch, beam_width: int | None = None,
                    length_penalty: float | None = None,
                    early_stopping: bool | str | None = None) -> None:
    """Fill `msg` (present even with every argument None: beam search with its defaults);
    early_stopping as HF generate's (False, True or "never")."""
    msg.SetInParent()
    if beam_width is not None:
        msg.beam_width = beam_width
    if length_penalty is not None:
        msg.length_penalty = length_penalty
    msg.early_stopping = _EARLY_STOPPING[early_stopping]


def set_structured_output(msg: pb.StructuredOutput, kind: str, spec: Any = None) -> None:
    """Fill `msg` with one constraint: ("json_object",), ("json_schema", a schema as a dict
    or JSON text), ("regex", str), ("choice", list of str) or ("grammar", str)."""
    if kind == "json_object":
        msg.json_object = True
    elif kind == "json_schema":
        msg.json_schema = spec if isinstance(spec, str) else json.dumps(spec)
    elif kind == "choice":
        msg.choice.options.extend(spec)
    elif kind in ("regex", "grammar"):
        setattr(msg, kind, spec)
    else:
        raise ValueError(f"unknown structured output kind {kind!r}")


def finish_reason_text(value: int) -> str | None:
    """The OpenAI spelling of a proto FinishReason ("stop", "length", "abort"); None while
    the choice is not finished."""
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def _logprobs(entries: Iterable[pb.TokenLogprob]
              ) -> tuple[tuple[int, float, tuple[tuple[int, float], ...]], ...]:
    return tuple((lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
                 for lp in entries)


_new_object = object.__new__


def chunk_from_proto(msg: pb.GenerateResponse) -> Chunk:
    """The `Chunk` of one streamed update. Runs once per update of every stream (once per
    token at stream interval 1, and in the gateway for every chunk it relays): the fields
    that are usually empty are read only when set, and the frozen dataclass is filled in one
    dict update instead of its ``__init__``'s one ``object.__setattr__`` per field."""
    usage = None
    if msg.HasField("usage"):
        usage = {"prompt_tokens": msg.usage.prompt_tokens,
                 "completion_tokens": msg.usage.completion_tokens,
                 "cached_prompt_tokens": msg.usage.cached_prompt_tokens}
    kind = msg.WhichOneof("stop_reason")
    chunk = _new_object(Chunk)
    chunk.__dict__.update(
        request_id=msg.request_id, index=msg.index, text=msg.text,
        token_ids=tuple(msg.token_ids),
        finish_reason=finish_reason_text(msg.finish_reason) if msg.finish_reason else None,
        logprobs=_logprobs(msg.logprobs) if msg.logprobs else (), usage=usage,
        prompt_tokens=msg.prompt_tokens, stop_reason=None if kind is None else getattr(msg, kind),
        prompt_logprobs=_logprobs(msg.prompt_logprobs) if msg.prompt_logprobs else (),
        tool_calls=tool_call_pieces(msg) if msg.tool_calls else (),
        beam_score=msg.beam_score if msg.HasField("beam_score") else None,
        prompt_token_ids=tuple(msg.prompt_token_ids) if msg.prompt_token_ids else ())
    return chunk


class RouterClient:
    """Async client over one channel. Errors surface as `grpc.aio.AioRpcError`.

    own_connection: give this client a connection of its own. By default gRPC lets channels
    to the same address with the same settings in one process share a connection, so they
    all reach the same one of a router's `--api-processes` (a connection stays with the
    process that accepted it).
    """

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None,
                 metadata: Sequence[tuple[str, str]] = (), own_connection: bool = False
                 ) -> None:
        options: list[tuple[str, int]] = [("grpc.max_receive_message_length", 64 << 20)]
        if own_connection:
            options.append(("grpc.use_local_subchannel_pool", 1))
        self.channel = (grpc.aio.secure_channel(address, credentials, options) if credentials
                        else grpc.aio.insecure_channel(address, options))
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)
        self.metadata = tuple(metadata)

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       **kwargs: Any) -> AsyncIterator[Chunk]:
        """Stream a generation; see `build_request` for the arguments."""
        request = kwargs.pop("request", None) or build_request(prompt, **kwargs)
        metadata = self.metadata
        if tracer() is not None:  # the caller's span becomes the router's span's parent
            metadata = (*metadata, *current_metadata())
        call = self.stub.Generate(request, timeout=timeout, metadata=metadata)
        try:
            async for msg in call:
                yield chunk_from_proto(msg)
        finally:
            call.cancel()  # a consumer that stops early cancels the request on the router

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Run a generation to the end and collect every choice."""
        out = Completion()
        async for chunk in self.generate(prompt, **kwargs):
            if chunk.usage is not None:
                out.usage = chunk.usage
                continue
            while len(out.texts) <= chunk.index:
                out.texts.append("")
                out.token_ids.append([])
                out.finish_reasons.append(None)
            out.texts[chunk.index] += chunk.text
            out.token_ids[chunk.index] += chunk.token_ids
            if chunk.finish_reason is not None:
                out.finish_reasons[chunk.index] = chunk.finish_reason
        return out

    async def tokenize(self, text: str | None = None,
                       messages: Sequence[dict[str, str]] | None = None) -> list[int]:
        return list((await self.tokenize_reply(text, messages)).token_ids)

    async def tokenize_reply(self, text: str | None = None,
                             messages: Sequence[dict[str, Any]] | None = None,
                             model: str = "", tools: Sequence[dict[str, Any]] | None = None
                             ) -> pb.TokenizeResponse:
        """The whole answer: ids, each token's text, the rendered prompt (`tools`: with
        `messages`, given to the chat template)."""
        req = pb.TokenizeRequest(model=model)
        if text is not None:
            req.text = text
        elif messages is not None:
            req.chat.messages.extend(message_to_proto(m) for m in messages)
            req.chat.tools.extend(tools_to_proto(tools or ()))
        return await self.stub.Tokenize(req, metadata=self.metadata)

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False,
                         model: str = "") -> str:
        reply = await self.stub.Detokenize(
            pb.DetokenizeRequest(model=model, token_ids=list(token_ids),
                                 skip_special_tokens=skip_special_tokens),
            metadata=self.metadata)
        return reply.text

    async def abort(self, request_id: str) -> None:
        """End a running request (any connection's); NOT_FOUND if none has that id."""
        await self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata)

    async def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout,
                                            metadata=self.metadata)

    async def stats(self, timeout: float | None = None) -> pb.GetStatsResponse:
        return await self.stub.GetStats(pb.GetStatsRequest(), timeout=timeout,
                                        metadata=self.metadata)

    async def health(self, service: str = "readiness", timeout: float | None = None) -> bool:
        """Whether the router's health service reports `service` ("liveness" or
        "readiness") as SERVING. Errors (router unreachable) raise `grpc.aio.AioRpcError`."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                 timeout=timeout, metadata=self.metadata)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
