"""The public InferenceService: a thin skin over the engine. Protos are converted in
`router.convert`; exceptions become statuses in `router.errors`.

The gRPC server (with health) is up while the pipeline starts, but what the service answers
with (the request limits, the model's context) depends on what the stages report. The
engine core sends it once (`ServedInfo`, in the front's `served` future), built from the
pipeline's shape and never changed; until then calls get UNAVAILABLE. The data-plane
transport of each hop (GetModelInfo's `hop_transports`) comes with every state the core
sends: a pipeline that re-links may link a hop differently.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from foundation.tokenizer import ModelTokenizer
from foundation.tracing import context_from_metadata, traceparent_of, tracer
from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc
from router.audit import AuditLog, AuditRecord, key_id
from router.beam_search import run_beam_search
from router.convert import (
    add_tool_call_deltas,
    delta_to_proto,
    generate_from_proto,
    logprobs_to_proto,
    prompt_from_proto,
    usage_to_proto,
)
from router.core.messages import ServedInfo
from router.errors import (
    ModelNotFoundError,
    RequestNotFoundError,
    UnavailableError,
    abort_with_status,
    failure_error,
    status_for,
    unary_errors,
)
from router.frontend import Frontend
from router.outputs import ChoiceDelta, PromptLogprobs, RequestDone, RequestFailed, StreamItem
from router.prompt_validation import RequestValidator, prompt_chars
from router.requests import GenerateRequest, PromptInput, RequestLimits
from router.tool_calls.parsers import ToolCallFormat
from router.validation import (
    ValidationError,
    validate_prompt,
    validate_token_ids,
)


@dataclass(frozen=True)
class ServedModel:
    """What this router serves, once the stages reported: the name clients use, the limits
    a request is checked against and the pipeline's layout (`info`)."""

    name: str
    info: ServedInfo


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, front: Frontend, tokenizer: ModelTokenizer, model_name: str,
                 audit: AuditLog | None = None,
                 tool_parser: ToolCallFormat | None = None) -> None:
        """`tool_parser`: the format tool calls are parsed from outputs in (the router's
        --tool-call-parser, resolved); None: only tool_choice none is served."""
        self.front = front
        self.tokenizer = tokenizer
        self.validate = RequestValidator(tokenizer, tool_parser)  # long prompts off the loop
        self.model_name = model_name
        self.draining = False
        self.audit = audit or AuditLog(enabled=False)
        # Beam searches running: between two steps one has no request on the front, so
        # draining waits for these too.
        self.beam_searches = 0

    def _model(self, requested: str = "") -> ServedModel:
        """The served model; UNAVAILABLE while starting, NOT_FOUND for another name."""
        served = self.front.served
        if not served.done() or served.exception() is not None:
            raise UnavailableError("the router is starting: its pipeline is not up yet")
        if requested and requested != self.model_name:
            raise ModelNotFoundError(f"model {requested!r} is not served here (this router "
                                     f"serves {self.model_name!r})")
        return ServedModel(self.model_name, served.result())

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        """Writes each update with `context.write` (no async-generator hop per message: this
        runs once per token per stream)."""
        await self._generate(request, context, context.write, "Generate")

    async def Complete(self, request: pb.CompleteRequest,
                       context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        """Generate's work, answered once: every choice whole, then the usage."""
        reply = pb.CompleteResponse()
        choices: dict[int, pb.CompletionChoice] = {}

        async def collect(msg: pb.GenerateResponse) -> None:
            reply.request_id = msg.request_id
            reply.prompt_logprobs.extend(msg.prompt_logprobs)
            if msg.HasField("usage"):
                reply.usage.CopyFrom(msg.usage)
                reply.timing.CopyFrom(msg.timing)
                return
            choice = choices.setdefault(msg.index, pb.CompletionChoice(index=msg.index))
            choice.text += msg.text
            choice.token_ids.extend(msg.token_ids)
            choice.logprobs.extend(msg.logprobs)
            if msg.finish_reason:
                choice.finish_reason = msg.finish_reason
            if (kind := msg.WhichOneof("stop_reason")) is not None:
                setattr(choice, kind, getattr(msg, kind))
            if msg.HasField("beam_score"):
                choice.beam_score = msg.beam_score
            add_tool_call_deltas(choice.tool_calls, msg.tool_calls)

        await self._generate(request.request, context, collect, "Complete")
        reply.choices.extend(choices[i] for i in sorted(choices))
        return reply

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                        write: Callable[[pb.GenerateResponse], Awaitable[None]],
                        method: str) -> None:
        """Run one request, handing each update to `write`; exceptions become statuses
        (`status_for`). Every call ends with one audit line (`router.audit`)."""
        audit = self.audit
        record = AuditRecord(context.peer(), key_id(context.invocation_metadata()),
                             request.model or self.model_name, request.request_id)
        span = _generate_span(request, record.model, context, method)
        try:
            served = self._model(request.model)
            if self.draining:
                raise UnavailableError("the router is draining; retry on another replica")
            req = await self.validate(generate_from_proto(request), served.info.limits)
            request_id = req.request_id
            record.request_id, record.prompt_tokens = request_id, len(req.prompt_token_ids)
            if span is not None:
                _request_attributes(span, req)
            first_token = span is not None
            if audit.content:
                record.prompt = self.tokenizer.decode(req.prompt_token_ids,
                                                      skip_special_tokens=False)
            with self.front.corks.stream(record.client):  # see `router.corks`
                first_response = True
                prompt_scores: PromptLogprobs | None = None  # for the first response
                async for items in self._stream(req, served, span):
                    for item in items:
                        if isinstance(item, PromptLogprobs):
                            prompt_scores = item
                        elif isinstance(item, ChoiceDelta):
                            if first_token and item.token_ids and span is not None:
                                first_token = False
                                _first_token(span, record.started)
                            response = delta_to_proto(request_id, item)
                            if first_response:
                                first_response = False
                                response.prompt_tokens = len(req.prompt_token_ids)
                                if req.sampling.prompt_logprobs is not None:
                                    response.prompt_token_ids.extend(req.prompt_token_ids)
                                if prompt_scores is not None:
                                    response.prompt_logprobs.extend(
                                        logprobs_to_proto(prompt_scores.entries))
                            await write(response)
                            if item.finish_reason is not None:
                                record.finish_reasons[item.index] = item.finish_reason.value
                            if audit.content:
                                record.output[item.index] = (record.output.get(item.index, "")
                                                             + item.text)
                        elif isinstance(item, RequestDone):
                            await write(usage_to_proto(request_id, item.usage, item.timing))
                            record.completion_tokens = item.usage.completion_tokens
                        elif isinstance(item, RequestFailed):
                            raise failure_error(item)
        except grpc.aio.AbortError:
            record.status = _code_name(context)
            raise
        except asyncio.CancelledError:
            record.status = "CANCELLED"  # the client went away
            raise
        except Exception as e:
            mapped = status_for(e)
            record.status = mapped[0].name if mapped is not None else "INTERNAL"
            await abort_with_status(context, e)
        finally:
            audit.emit(record)
            if span is not None:
                _end_generate_span(span, record)

    def _stream(self, req: GenerateRequest, served: ServedModel, span: Span | None
                ) -> AsyncIterator[list[StreamItem]]:
        """The request's stream: the front's, or a beam search's over the front."""
        if req.beam is not None:
            return self._beam_search(req, served)
        return self.front.submit(req, traceparent_of(span) if span is not None else "")

    async def _beam_search(self, req: GenerateRequest, served: ServedModel
                           ) -> AsyncIterator[list[StreamItem]]:
        self.beam_searches += 1
        try:
            async for items in run_beam_search(
                    self.front, req, self.tokenizer.special.eos_ids,
                    served.info.limits.max_logprobs, self.tokenizer.decode):
                yield items
        finally:
            self.beam_searches -= 1

    @unary_errors
    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        served = self._model(request.model)
        prompt = prompt_from_proto(request)
        ids, tokens, text = await self.validate.offload(
            prompt_chars(prompt), self._tokenized, prompt, served.info.limits)
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens, prompt=text)

    def _tokenized(self, prompt: PromptInput, limits: RequestLimits
                   ) -> tuple[tuple[int, ...], list[str], str]:
        """Tokenize's answer, on the loop or the validator's pool (a long prompt): the
        prompt's ids, each id's token, and the text they decode to."""
        ids = validate_prompt(prompt, limits, self.tokenizer)
        tokens = [self.tokenizer.tokenizer.id_to_token(i) or "" for i in ids]
        return ids, tokens, self.tokenizer.decode(ids, skip_special_tokens=False)

    @unary_errors
    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        served = self._model(request.model)
        ids = validate_token_ids(request.token_ids, served.info.limits)
        return pb.DetokenizeResponse(text=self.tokenizer.decode(
            ids, skip_special_tokens=request.skip_special_tokens))

    @unary_errors
    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        self._model()
        if not request.request_id:
            raise ValidationError("request_id", "request_id must not be empty")
        if not await self.front.abort_anywhere(request.request_id):
            raise RequestNotFoundError(f"no running request has request_id "
                                       f"{request.request_id!r}")
        return pb.AbortResponse()

    @unary_errors
    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        served = self._model()
        info, limits = served.info, served.info.limits
        return pb.GetModelInfoResponse(
            model=served.name, context_length=limits.max_model_len,
            vocab_size=limits.vocab_size, num_stages=info.num_stages,
            tp_size=info.tp_size, block_size=info.block_size, dtype=info.dtype,
            max_tokens_limit=limits.max_tokens_cap, max_n=limits.max_n,
            max_logprobs=limits.max_logprobs, hop_transports=self.front.hop_transports,
            micro_batches=info.micro_batches,
        )

    @unary_errors
    async def GetStats(self, request: pb.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        self._model()
        remaining = context.time_remaining()  # None: the caller set no deadline
        stats = await self.front.stats(5.0 if remaining is None else min(5.0, remaining))
        stages = [pb.StageStats(stage=s.stage, ready=s.ready, layer_start=s.layer_start,
                                layer_end=s.layer_end, kv_blocks_used=s.kv_blocks_used,
                                kv_blocks_total=s.kv_blocks_total,
                                num_sequences=s.num_sequences, transport=s.transport,
                                device=s.device, steps=s.steps, step_time_ms=s.step_time_ms,
                                bubble_fraction=s.bubble_fraction)
                  for s in stats.stages]
        hit = (stats.prefix_hit_tokens / stats.prefix_query_tokens
               if stats.prefix_query_tokens else 0.0)
        return pb.GetStatsResponse(
            num_waiting=stats.num_waiting, num_running=stats.num_running,
            kv_blocks_used=stats.kv_blocks_used, kv_blocks_total=stats.kv_blocks_total,
            kv_blocks_cached=stats.kv_blocks_cached, prefix_cache_hit_rate=hit,
            stages=stages, steps=stats.steps,
            requests_finished=stats.requests_finished,
        )


def _generate_span(request: pb.GenerateRequest, model: str,
                   context: grpc.aio.ServicerContext, method: str = "Generate") -> Span | None:
    """The call's span (None when tracing is off), a child of the caller's trace context
    (the gateway's, or a client's `traceparent` metadata), named and attributed as
    OpenTelemetry's GenAI conventions say."""
    t = tracer()
    if t is None:
        return None
    operation = "chat" if request.WhichOneof("input") == "chat" else "text_completion"
    return t.start_span(
        f"{operation} {model}", context_from_metadata(context.invocation_metadata()),
        kind=SpanKind.SERVER, attributes={
            "gen_ai.operation.name": operation, "gen_ai.system": "stagemesh",
            "gen_ai.request.model": model, "rpc.system": "grpc",
            "rpc.service": "stagemesh.v1.InferenceService", "rpc.method": method})


def _request_attributes(span: Span, req: GenerateRequest) -> None:
    span.set_attributes({
        "gen_ai.request.id": req.request_id, "gen_ai.request.max_tokens": req.max_tokens,
        "gen_ai.request.temperature": req.sampling.temperature,
        "gen_ai.request.top_p": req.sampling.top_p, "gen_ai.request.choice.count": req.n,
        "gen_ai.usage.input_tokens": len(req.prompt_token_ids)})


def _first_token(span: Span, started: float) -> None:
    """`started`: the call's start (time.monotonic())."""
    span.add_event("first_token")
    span.set_attribute("gen_ai.server.time_to_first_token", time.monotonic() - started)


def _end_generate_span(span: Span, record: AuditRecord) -> None:
    span.set_attributes({
        "gen_ai.usage.output_tokens": record.completion_tokens,
        "gen_ai.response.finish_reasons": [record.finish_reasons[i]
                                           for i in sorted(record.finish_reasons)],
        "rpc.grpc.status_code": record.status})
    if record.status != "OK":
        span.set_status(Status(StatusCode.ERROR, record.status))
    span.end()


def _code_name(context: grpc.aio.ServicerContext) -> str:
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"


def add_services(server: grpc.aio.Server, servicer: InferenceServicer,
                 health_servicer: health.HealthServicer) -> None:
    """Serve the InferenceService, gRPC health and server reflection (for the three) on
    `server`; every front's server is built the same way."""
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.DESCRIPTOR.services_by_name["InferenceService"].full_name,
             health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
