"""The StageService servicer in-process: a real grpc.aio server on 127.0.0.1 in the test's
event loop, over a single-stage pipeline built from a tiny random checkpoint (and one with
the null runner). Tokens are compared with the offline pipeline's greedy ones."""

from __future__ import annotations

import asyncio
import re
import time
from array import array
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
import torch

from protos.stagemesh.stage.v1 import stage_pb2 as pb
from protos.stagemesh.stage.v1 import stage_pb2_grpc
from router.pipeline.convert import cached_batch_to_proto
from router.scheduler import CachedSeq
from stage_worker.config import StageConfig
from stage_worker.main import stage_servicer
from stage_worker.offline import LocalPipeline, LocalPipelineConfig, greedy_generate
from stage_worker.parallel import TPGroup
from stage_worker.plan import StageOutcome, StagePlan
from stage_worker.service import StageServicer
from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint

BLOCK, BLOCKS, MAX_TOKENS, MAX_SEQS, MAX_NEW = 8, 64, 48, 4, 8
GREEDY = pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
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


def test_describe_and_greedy_tokens_match_the_offline_pipeline(checkpoint: Path) -> None:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (5, 19)]
    want = greedy_generate(LocalPipeline(LocalPipelineConfig(checkpoint, 1, block_size=BLOCK,
                                                             num_blocks=BLOCKS)),
                           prompts, max_new_tokens=MAX_NEW)
    tables = [[3, 9, 1, 60], [2, 8, 7, 63, 5]]
    cfg = StageConfig(checkpoint, block_size=BLOCK, num_blocks=BLOCKS,
                      max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS)

    async def body() -> tuple[pb.DescribeResponse, list[list[int]], pb.DescribeResponse]:
        async with serving(cfg) as stub:
            info = await stub.Describe(pb.DescribeRequest())
            plans = [prefill([10, 11], prompts, tables)]
            got: list[list[int]] = [[], []]
            call = RunStream(stub)
            for step in range(MAX_NEW):
                await call.write(plans[-1])
                result = await call.read()
                assert not result.error, result.error
                assert [s for s, _ in sampled(result)] == [10, 11]
                assert len(result.tokens) == 0  # nobody asked for logprobs
                for row, (_, token) in enumerate(sampled(result)):
                    got[row].append(token)
                plans.append(decodes(step + 1, [(10 + row, len(p) + step, got[row][-1])
                                                for row, p in enumerate(prompts)]))
            assert result.num_sequences == 2 and result.kv_blocks_used == 9
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            after = await stub.Describe(pb.DescribeRequest())  # the stream closed
            return info, got, after

    info, got, after = asyncio.run(body())
    assert got == want
    assert (info.max_num_batched_tokens, info.max_num_seqs, info.model_impl) == (
        MAX_TOKENS, MAX_SEQS, "llama")
    assert (info.num_kv_blocks, info.block_size, info.vocab_size, info.hidden_size) == (
        BLOCKS, BLOCK, 160, 64)
    assert (info.layer_start, info.layer_end, info.device, info.dtype) == (0, 4, "cpu",
                                                                           "float32")
    assert (after.num_sequences, after.kv_blocks_used) == (0, 0)


@pytest.mark.parametrize(("plan", "limit"), [
    (prefill([1, 2], [[5] * 30, [6] * 19], [[0, 1, 2, 3], [4, 5, 6]]),
     r"49 tokens, more than this stage's max_num_batched_tokens \(48\)"),
    (prefill(list(range(5)), [[1]] * 5, [[i] for i in range(5)]),
     r"5 sequences, more than this stage's max_num_seqs \(4\)"),
    (prefill([1], [[5] * 9], [[0, 64]]),
     r"sequence 1: block id 64 is outside this stage's KV pool \[0, 64\)"),
], ids=["tokens", "sequences", "block-id"])
def test_a_plan_over_capacity_is_an_error_naming_the_limit(checkpoint: Path, plan: pb.StepPlan,
                                                            limit: str) -> None:
    cfg = StageConfig(checkpoint, block_size=BLOCK, num_blocks=BLOCKS,
                      max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS)

    async def body() -> tuple[list[pb.StepResult], pb.DescribeResponse]:
        async with serving(cfg) as stub:
            ok = prefill([20], [[4] * 8], [[10]])
            results = await run_plans(stub, [ok, pb.StepPlan(step_id=1, new_seqs=plan.new_seqs)])
            return results, await stub.Describe(pb.DescribeRequest())

    results, after = asyncio.run(body())
    assert [r.step_id for r in results] == [0, 1]
    assert not results[0].error and len(sampled(results[0])) == 1
    assert results[1].error.startswith("stage 0: PlanError: step 1")
    assert sampled(results[1]) == []
    assert re.search(limit, results[1].error), results[1].error
    assert after.num_sequences == 0  # the failed stream dropped what it held



def test_plans_of_several_steps_in_one_message(checkpoint: Path) -> None:
    """The router sends the plans it has ready together: a prefill and run-ahead decodes
    (each taking its input from the step before) in one message give the offline greedy
    tokens, answered in step order, the answers ready together in one message."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (6, 11)]
    want = greedy_generate(LocalPipeline(LocalPipelineConfig(checkpoint, 1, block_size=BLOCK,
                                                             num_blocks=BLOCKS)),
                           prompts, max_new_tokens=MAX_NEW)
    cfg = StageConfig(checkpoint, block_size=BLOCK, num_blocks=BLOCKS,
                      max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS)
    plans = [prefill([4, 5], prompts, [[0, 1, 2], [3, 4, 5]])]
    for step in range(1, MAX_NEW):
        cached = [CachedSeq(seq_id, (), len(p) + step - 1, 1, (), step - 1, True)
                  for seq_id, p in zip((4, 5), prompts, strict=True)]
        plans.append(pb.StepPlan(step_id=step,
                                 cached_batch=cached_batch_to_proto(cached, True)))

    async def body() -> list[pb.StepResults]:
        async with serving(cfg) as stub:
            call = stub.Run()
            await call.write(pb.StepPlans(plans=plans))
            await call.done_writing()
            return [m async for m in call]

    messages = asyncio.run(body())
    results = [r for m in messages for r in m.results]
    assert [r.step_id for r in results] == list(range(MAX_NEW))
    assert not any(r.error for r in results)
    got = [[t for r in results for s, t in sampled(r) if s == seq_id] for seq_id in (4, 5)]
    assert got == want
    assert len(messages) <= len(results)


def test_null_runner_samples_seq_id_plus_output_index(checkpoint: Path) -> None:
    cfg = StageConfig(checkpoint, model_impl="null", max_num_batched_tokens=4096)

    async def body() -> tuple[pb.DescribeResponse, list[pb.StepResult]]:
        async with serving(cfg) as stub:
            info = await stub.Describe(pb.DescribeRequest())
            plans = [
                prefill([158, 3], [[1, 2, 3], [4] * 40], [[0], [1, 2, 3]]),
                decodes(1, [(158, 3, 158), (3, 40, 3)]),
            ]
            return info, await run_plans(stub, plans)

    info, results = asyncio.run(body())
    assert (info.model_impl, info.num_kv_blocks) == ("null", 65536)
    assert (info.max_num_batched_tokens, info.max_num_seqs) == (4096, 256)
    assert [sampled(r) for r in results] == [[(158, 158), (3, 3)], [(158, 159), (3, 4)]]


@pytest.mark.parametrize("repeat", [1, 0], ids=["repeated", "older"])
def test_a_step_id_that_does_not_increase_is_refused(checkpoint: Path, repeat: int) -> None:
    """Step ids increase along a Run stream: a plan repeating or going back to an earlier id
    is refused before anything runs, and the next Run stream starts over."""
    cfg = StageConfig(checkpoint, model_impl="null")

    async def body() -> tuple[list[pb.StepResult], list[pb.StepResult]]:
        async with serving(cfg) as stub:
            first = await run_plans(stub, [prefill([7], [[1, 2, 3]], [[0]]),
                                           decodes(1, [(7, 3, 7)]),
                                           decodes(repeat, [(7, 4, 7)])])
            again = await run_plans(stub, [prefill([7], [[1, 2, 3]], [[0]])])
            return first, again

    first, again = asyncio.run(body())
    assert [r.step_id for r in first] == [0, 1, repeat]
    assert not first[1].error
    assert first[2].error == (f"stage 0: PlanError: step {repeat} after step 1: the step ids "
                              "of a Run stream must increase")
    assert [r.step_id for r in again] == [0] and not again[0].error


def test_a_run_that_ends_frees_a_step_waiting_for_its_upstream(checkpoint: Path) -> None:
    """Stage 1 of 2 waits for activations that never come (nobody dials its upstream
    listener); when its Run stream ends, the waiting step fails at once instead of at the
    step timeout, so the next router's calls (which run on the same step thread) are served
    without delay."""
    cfg = StageConfig(checkpoint, model_impl="null", stage_index=1, num_stages=2,
                      step_timeout_s=20.0)

    async def body() -> float:
        async with serving(cfg) as stub:
            await stub.Connect(pb.ConnectRequest(role=pb.LINK_ROLE_LISTEN_UPSTREAM,
                                                 address="127.0.0.1", epoch=1,
                                                 link_token=bytes(range(32))))
            call = RunStream(stub)
            await call.write(prefill([3], [[1, 2, 3]], [[0]]))
            await asyncio.sleep(0.3)  # the step is waiting for its activations
            call.call.cancel()  # the router went away
            started = time.monotonic()
            await stub.Connect(pb.ConnectRequest(role=pb.LINK_ROLE_LISTEN_UPSTREAM,
                                                 address="127.0.0.1", epoch=2,
                                                 link_token=bytes(range(32))), timeout=15)
            return time.monotonic() - started

    assert asyncio.run(body()) < 5.0  # not the 20 s step timeout


def test_a_malformed_cached_batch_fails_its_step_naming_the_field(checkpoint: Path) -> None:
    """A plan whose packed columns disagree is refused when it is converted: that step's
    answer is a PlanError naming the column and the lengths, and the stream ends."""
    cfg = StageConfig(checkpoint, model_impl="null")
    bad = decodes(1, [(1, 3, 1), (2, 3, 2)])
    bad.cached_batch.num_new = bad.cached_batch.num_new[:4]

    async def body() -> tuple[list[pb.StepResult], pb.DescribeResponse]:
        async with serving(cfg) as stub:
            plans = [prefill([1, 2], [[1, 2, 3], [4, 5, 6]], [[0], [1]]), bad,
                     decodes(2, [(1, 4, 1)])]
            return await run_plans(stub, plans), await stub.Describe(pb.DescribeRequest())

    results, after = asyncio.run(body())
    assert [r.step_id for r in results] == [0, 1]
    assert not results[0].error
    assert results[1].error == ("stage 0: PlanError: step 1: cached_batch.num_new holds 1 "
                                "int32s for 2 sequences (seq_ids)")
    assert after.num_sequences == 0  # the failed stream dropped what it held


def test_logprob_records_only_for_the_sequences_that_asked(checkpoint: Path) -> None:
    cfg = StageConfig(checkpoint, block_size=BLOCK, num_blocks=BLOCKS,
                      max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS)
    asks = pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0,
                             logprobs=2)
    plan = prefill([4, 5, 6], [[1, 2, 3], [4, 5], [6]], [[0], [1], [2]])
    plan.new_seqs[1].sampling.CopyFrom(asks)

    async def body() -> list[pb.StepResult]:
        async with serving(cfg) as stub:
            return await run_plans(stub, [plan])

    (result,) = asyncio.run(body())
    tokens = dict(sampled(result))
    assert list(tokens) == [4, 5, 6] and [t.seq_id for t in result.tokens] == [5]
    (record,) = result.tokens
    assert record.token_id == tokens[5] == record.top_token_ids[0]  # greedy: the most likely
    assert len(record.top_logprobs) == 2 and record.logprob == record.top_logprobs[0] < 0


def test_plans_sent_ahead_run_in_order_and_a_failure_skips_the_rest(checkpoint: Path) -> None:
    """The router writes plans before the results of earlier ones come back: each is queued
    on the stage's worker as it arrives and answered in order; a refused step ends the
    stream, and the steps queued behind it never run."""
    servicer = stage_servicer(StageConfig(checkpoint, model_impl="null"), TPGroup())
    ran: list[int] = []
    leader = servicer.leader
    assert leader.overlaps  # one stage: steps go through step_overlapped
    step_overlapped = leader.step_overlapped

    def recording(plan: StagePlan, deliver: Callable[[StageOutcome], None],
                  more_coming: Callable[[], bool]) -> None:
        ran.append(plan.step_id)
        step_overlapped(plan, deliver, more_coming)

    leader.step_overlapped = recording  # type: ignore[method-assign]

    def decode(step: int, seq_id: int = 1) -> pb.StepPlan:
        return decodes(step, [(seq_id, 2 + step, 5)])

    async def body() -> list[pb.StepResult]:
        async with serving_servicer(servicer) as stub:
            call = RunStream(stub)
            plans = [prefill([1], [[1, 2, 3]], [[0]]), decode(1), decode(2, seq_id=9),
                     decode(3), decode(4)]
            for plan in plans:
                await call.write(plan)
            results = []
            while (result := await call.read()) is not grpc.aio.EOF:
                results.append(result)
            return results

    results = asyncio.run(body())
    assert [r.step_id for r in results] == [0, 1, 2]
    assert sampled(results[1]) == [(1, 2)]  # the null model: seq_id + outputs so far
    assert results[2].error.startswith("stage 0: PlanError: step 2, sequence 9 is not held")
    assert ran == [0, 1, 2]


def test_a_cpu_stage_offers_tcp_and_refuses_other_transports_naming_them(
        checkpoint: Path) -> None:
    """Describe lists what the stage offers and where it runs; a Connect for a transport the
    stage does not offer (cuda_ipc on CPU), for one not implemented (nccl), or for a feedback
    link other than tcp, is refused with the status and the names; tcp still links after."""
    cfg = StageConfig(checkpoint, model_impl="null", stage_index=1, num_stages=2)

    def listen(transport: int, role: int = pb.LINK_ROLE_LISTEN_UPSTREAM) -> pb.ConnectRequest:
        return pb.ConnectRequest(role=role, transport=transport, address="127.0.0.1", epoch=1,
                                 link_token=bytes(range(32)))

    async def body() -> tuple[pb.DescribeResponse, list[tuple[grpc.StatusCode, str]], str]:
        async with serving(cfg) as stub:
            info = await stub.Describe(pb.DescribeRequest())
            errors = []
            for request in (listen(pb.TRANSPORT_CUDA_IPC), listen(pb.TRANSPORT_NCCL),
                            listen(pb.TRANSPORT_CUDA_IPC, pb.LINK_ROLE_CONNECT_FEEDBACK)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Connect(request)
                errors.append((e.value.code(), e.value.details() or ""))
            ok = await stub.Connect(listen(pb.TRANSPORT_TCP))
            return info, errors, ok.address

    info, errors, address = asyncio.run(body())
    assert list(info.transports) == [pb.TRANSPORT_TCP]
    assert info.host_id and "/" in info.host_id
    assert errors[0] == (grpc.StatusCode.FAILED_PRECONDITION, "transport TRANSPORT_CUDA_IPC "
                         "is not offered by this stage (it offers TRANSPORT_TCP)")
    assert errors[1][0] == grpc.StatusCode.UNIMPLEMENTED and "TRANSPORT_NCCL" in errors[1][1]
    assert errors[2] == (grpc.StatusCode.INVALID_ARGUMENT,
                         "the feedback link is TRANSPORT_TCP only")
    assert address.startswith("127.0.0.1:")
