"""The public InferenceService: a thin skin over the engine. Protos are converted in
`router.convert`; exceptions become statuses in `router.errors`."""

from __future__ import annotations

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
    name: str
    dtype: str
    tp_size: int


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, engine: Engine, tokenizer: ModelTokenizer, limits: RequestLimits,
                 model: ServedModel) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.model = model
        self.draining = False

    def _check_model(self, name: str) -> None:
        if name and name != self.model.name:
            raise ModelNotFoundError(f"model {name!r} is not served here (this router serves "
                                     f"{self.model.name!r})")

    @stream_errors
    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        self._check_model(request.model)
        if self.draining:
            raise UnavailableError("the router is draining; retry on another replica")
        req = validate_request(generate_from_proto(request), self.limits, self.tokenizer)
        try:
            stream = self.engine.submit(req)
        except RuntimeError as e:
            raise UnavailableError(str(e)) from e
        async for items in stream:
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
        self._check_model(request.model)
        ids = validate_prompt(prompt_from_proto(request), self.limits, self.tokenizer)
        tokens = [self.tokenizer.tokenizer.id_to_token(i) or "" for i in ids]
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens,
                                   prompt=self.tokenizer.decode(ids, skip_special_tokens=False))

    @unary_errors
    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        shape = self.engine.pipeline.shape
        return pb.GetModelInfoResponse(
            model=self.model.name, context_length=self.limits.max_model_len,
            vocab_size=self.limits.vocab_size,
            num_stages=len(self.engine.pipeline.stages),
            tp_size=shape.tp_size if shape else self.model.tp_size,
            block_size=shape.block_size if shape else 0, dtype=self.model.dtype,
            max_tokens_limit=self.limits.max_tokens_cap, max_n=self.limits.max_n,
            max_logprobs=self.limits.max_logprobs,
        )

    @unary_errors
    async def GetStats(self, request: pb.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        stats = self.engine.scheduler.stats()
        kv = stats.kv
        stages = []
        for i, info in enumerate(await self.engine.pipeline.stage_stats()):
            if info is None:
                stages.append(pb.StageStats(stage=i, ready=False))
                continue
            stages.append(pb.StageStats(
                stage=i, layer_start=info.layer_start, layer_end=info.layer_end,
                kv_blocks_used=info.kv_blocks_used, kv_blocks_total=info.num_kv_blocks,
                num_sequences=info.num_sequences,
                ready=self.engine.pipeline.state is PipelineState.READY))
        hit = kv.prefix_hit_tokens / kv.prefix_query_tokens if kv.prefix_query_tokens else 0.0
        return pb.GetStatsResponse(
            num_waiting=stats.num_waiting, num_running=stats.num_running,
            kv_blocks_used=kv.num_used_blocks, kv_blocks_total=kv.num_blocks,
            kv_blocks_cached=kv.num_cached_free_blocks, prefix_cache_hit_rate=hit,
            stages=stages, steps=self.engine.steps,
            requests_finished=self.engine.requests_finished,
        )
