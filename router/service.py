"""The public InferenceService: a thin skin over the engine. Protos are converted in
`router.convert`; exceptions become statuses in `router.errors`.

The gRPC server (with health) is up while the pipeline starts, but what the service answers
with (the request limits, the model's context) depends on what the stages report. So the
servicer is handed a future of the `ServedModel`, built once from the pipeline's shape and
never changed; until it resolves, calls get UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from foundation.tokenizer import ModelTokenizer
from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc
from router.convert import delta_to_proto, generate_from_proto, prompt_from_proto, usage_to_proto
from router.engine import Engine
from router.errors import ModelNotFoundError, UnavailableError, stream_errors, unary_errors
from router.outputs import ChoiceDelta, RequestDone, RequestFailed
from router.pipeline import PipelineState
from router.requests import RequestLimits
from router.validation import validate_prompt, validate_request


@dataclass(frozen=True)
class ServedModel:
    """What this router serves, once the stages reported: the name clients use, the limits
    a request is checked against, and the pipeline's layout for GetModelInfo."""

    name: str
    limits: RequestLimits
    dtype: str
    tp_size: int
    num_stages: int
    block_size: int


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, engine: Engine, tokenizer: ModelTokenizer,
                 served: asyncio.Future[ServedModel]) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._served = served
        self.draining = False

    def _model(self, requested: str = "") -> ServedModel:
        """The served model; UNAVAILABLE while starting, NOT_FOUND for another name."""
        if not self._served.done():
            raise UnavailableError("the router is starting: its pipeline is not up yet")
        served = self._served.result()
        if requested and requested != served.name:
            raise ModelNotFoundError(f"model {requested!r} is not served here (this router "
                                     f"serves {served.name!r})")
        return served

    @stream_errors
    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        served = self._model(request.model)
        if self.draining:
            raise UnavailableError("the router is draining; retry on another replica")
        req = validate_request(generate_from_proto(request), served.limits, self.tokenizer)
        async for items in self.engine.submit(req):
            for item in items:
                if isinstance(item, ChoiceDelta):
                    yield delta_to_proto(req.request_id, item)
                elif isinstance(item, RequestDone):
                    yield usage_to_proto(req.request_id, item.usage)
                elif isinstance(item, RequestFailed):
                    raise UnavailableError(item.message)

    @unary_errors
    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        served = self._model(request.model)
        ids = validate_prompt(prompt_from_proto(request), served.limits, self.tokenizer)
        tokens = [self.tokenizer.tokenizer.id_to_token(i) or "" for i in ids]
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens,
                                   prompt=self.tokenizer.decode(ids, skip_special_tokens=False))

    @unary_errors
    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        served = self._model()
        limits = served.limits
        return pb.GetModelInfoResponse(
            model=served.name, context_length=limits.max_model_len,
            vocab_size=limits.vocab_size, num_stages=served.num_stages,
            tp_size=served.tp_size, block_size=served.block_size, dtype=served.dtype,
            max_tokens_limit=limits.max_tokens_cap, max_n=limits.max_n,
            max_logprobs=limits.max_logprobs,
        )

    @unary_errors
    async def GetStats(self, request: pb.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        self._model()
        stats = self.engine.scheduler.stats()
        kv = stats.kv
        ready = self.engine.pipeline.state is PipelineState.READY
        stages = []
        for i, info in enumerate(await self.engine.pipeline.stage_stats()):
            if info is None:
                stages.append(pb.StageStats(stage=i, ready=False))
                continue
            stages.append(pb.StageStats(
                stage=i, layer_start=info.layer_start, layer_end=info.layer_end,
                kv_blocks_used=info.kv_blocks_used, kv_blocks_total=info.num_kv_blocks,
                num_sequences=info.num_sequences, ready=ready))
        hit = kv.prefix_hit_tokens / kv.prefix_query_tokens if kv.prefix_query_tokens else 0.0
        return pb.GetStatsResponse(
            num_waiting=stats.num_waiting, num_running=stats.num_running,
            kv_blocks_used=kv.num_used_blocks, kv_blocks_total=kv.num_blocks,
            kv_blocks_cached=kv.num_cached_free_blocks, prefix_cache_hit_rate=hit,
            stages=stages, steps=self.engine.steps,
            requests_finished=self.engine.requests_finished,
        )
