"""The stage servicer tests' harness: a tiny checkpoint, an in-process grpc.aio StageService,
its Run stream, and plan builders."""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from protos.stagemesh.stage.v1 import stage_pb2 as pb
from protos.stagemesh.stage.v1 import stage_pb2_grpc
from router.pipeline.convert import cached_batch_to_proto
from router.scheduler import CachedSeq
from stage_worker.config import StageConfig
from stage_worker.main import stage_servicer
from stage_worker.parallel import TPGroup
from stage_worker.service import StageServicer
from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint

BLOCK, BLOCKS, MAX_TOKENS, MAX_SEQS, MAX_NEW = 8, 64, 48, 4, 8
GREEDY = pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0)


def service_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint the servicer tests serve (each module's `checkpoint` fixture)."""
    path = tmp_path_factory.mktemp("llama_gqa_untied")
    write_tiny_checkpoint("llama_gqa_untied", path)
    return path


@asynccontextmanager
async def serving(cfg: StageConfig) -> AsyncIterator[stage_pb2_grpc.StageServiceStub]:
    """A stage's servicer on a fresh port; yields a stub reaching it."""
    async with serving_servicer(stage_servicer(cfg, TPGroup())) as stub:
        yield stub


@asynccontextmanager
async def serving_servicer(servicer: StageServicer
                           ) -> AsyncIterator[stage_pb2_grpc.StageServiceStub]:
    """`servicer` on a fresh port (closed on exit); yields a stub reaching it."""
    server = grpc.aio.server()
    stage_pb2_grpc.add_StageServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield stage_pb2_grpc.StageServiceStub(channel)
    finally:
        await server.stop(grace=None)
        servicer.close()


class RunStream:
    """A Run stream as one plan per message down and one result at a time up (results that
    came in one message are handed out one by one)."""

    def __init__(self, stub: stage_pb2_grpc.StageServiceStub) -> None:
        self.call = stub.Run()
        self._results: deque[pb.StepResult] = deque()

    async def write(self, plan: pb.StepPlan) -> None:
        await self.call.write(pb.StepPlans(plans=[plan]))

    async def read(self) -> pb.StepResult | object:
        while not self._results:
            msg = await self.call.read()
            if msg is grpc.aio.EOF:
                return msg
            self._results.extend(msg.results)
        return self._results.popleft()

    async def done_writing(self) -> None:
        await self.call.done_writing()


async def run_plans(stub: stage_pb2_grpc.StageServiceStub,
                    plans: list[pb.StepPlan]) -> list[pb.StepResult]:
    """Send `plans` on one Run stream, one at a time; results up to the stream's end."""
    call = RunStream(stub)
    results = []
    for plan in plans:
        await call.write(plan)
        result = await call.read()
        if result is grpc.aio.EOF:
            break
        results.append(result)
        if result.error:
            break
    await call.done_writing()
    while (rest := await call.read()) is not grpc.aio.EOF:
        results.append(rest)
    return results


def sampled(result: pb.StepResult) -> list[tuple[int, int]]:
    """(seq_id, token_id) of every sampled token, from the packed arrays, in batch order."""
    seq_ids, token_ids = array("q"), array("q")
    seq_ids.frombytes(result.sampled_seq_ids)
    token_ids.frombytes(result.sampled_token_ids)
    return list(zip(seq_ids, token_ids, strict=True))


def prefill(seq_ids: list[int], prompts: list[list[int]],
            tables: list[list[int]]) -> pb.StepPlan:
    return pb.StepPlan(step_id=0, new_seqs=[
        pb.NewSequence(seq_id=i, token_ids=p, prompt_len=len(p), block_ids=t, num_computed=0,
                       num_new=len(p), sample=True, sampling=GREEDY)
        for i, p, t in zip(seq_ids, prompts, tables, strict=True)])


def decodes(step: int, rows: list[tuple[int, int, int]]) -> pb.StepPlan:
    """A step of decodes, one (seq_id, num_computed, input token) per row, as the router
    packs it."""
    cached = [CachedSeq(seq_id, (), num_computed, 1, (token,), None, True)
              for seq_id, num_computed, token in rows]
    return pb.StepPlan(step_id=step, cached_batch=cached_batch_to_proto(cached, True))
