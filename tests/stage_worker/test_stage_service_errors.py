"""The StageService servicer refusing what it must and failing steps cleanly: step ids that
do not increase, a Run that ends under a waiting step, malformed batches, plans after a
failure, transports it cannot offer (the harness of test_stage_service.py)."""


from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from protos.stagemesh.stage.v1 import stage_pb2 as pb
from protos.stagemesh.stage.v1 import stage_pb2_grpc
from stage_worker.config import StageConfig
from stage_worker.main import stage_servicer
from stage_worker.parallel import TPGroup
from stage_worker.plan import StageOutcome, StagePlan
from tests.stage_worker.stage_service_harness import (
    BLOCK,
    BLOCKS,
    MAX_SEQS,
    MAX_TOKENS,
    RunStream,
    decodes,
    prefill,
    run_plans,
    sampled,
    service_checkpoint,
    serving,
    serving_servicer,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return service_checkpoint(tmp_path_factory)


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


def test_a_cpu_stage_offers_tcp_and_unix_and_refuses_other_transports_naming_them(
        checkpoint: Path) -> None:
    """Describe lists what the stage offers and where it runs; a Connect for a transport the
    stage does not offer (cuda_ipc and nccl on CPU), or for a feedback link other than tcp
    or unix, is refused with the status and the names; tcp and unix still listen after."""
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
            unix = await stub.Connect(listen(pb.TRANSPORT_UNIX))
            return info, errors, ok.address + " " + unix.address

    info, errors, address = asyncio.run(body())
    assert list(info.transports) == [pb.TRANSPORT_TCP, pb.TRANSPORT_UNIX]
    assert info.host_id and "/" in info.host_id
    offers = "(it offers TRANSPORT_TCP, TRANSPORT_UNIX)"
    assert errors[0] == (grpc.StatusCode.FAILED_PRECONDITION, "transport TRANSPORT_CUDA_IPC "
                         f"is not offered by this stage {offers}")
    assert errors[1] == (grpc.StatusCode.FAILED_PRECONDITION, "transport TRANSPORT_NCCL "
                         f"is not offered by this stage {offers}")
    assert errors[2] == (grpc.StatusCode.INVALID_ARGUMENT,
                         "the feedback link is TRANSPORT_TCP or TRANSPORT_UNIX")
    tcp, unix = address.split()
    assert tcp.startswith("127.0.0.1:") and unix.startswith("unix:@stagemesh-dataplane-")


def test_a_stage_stopping_as_its_run_stream_ends_still_reports_what_it_dropped(
        checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`serve` stops the stages as soon as the router has gone: a Run handler still waiting
    for its stream's reset when the process stops is cancelled there. The reset still runs
    on the step thread, and so does its log line, which names the sequences dropped."""
    servicer = stage_servicer(StageConfig(checkpoint, model_impl="null"), TPGroup())
    started, gate = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        gate.wait()

    async def body() -> None:
        server = grpc.aio.server()
        stage_pb2_grpc.add_StageServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = RunStream(stage_pb2_grpc.StageServiceStub(channel))
            await call.write(prefill([1, 2], [[1, 2, 3], [4, 5]], [[0], [1]]))
            assert (await call.read()).step_id == 0  # type: ignore[attr-defined]
            servicer._worker.run_later(hold)  # the reset waits behind this
            while not started.is_set():
                await asyncio.sleep(0.01)
            call.call.cancel()  # the router went
            while not servicer._worker._queue.qsize():  # the handler asked for the reset
                await asyncio.sleep(0.01)
        await server.stop(grace=None)  # the stage stops: the waiting handler is cancelled

    with caplog.at_level(logging.INFO, logger="stagemesh.stage"):
        asyncio.run(body())  # what is still pending is cancelled on the way out
        gate.set()
        servicer.close()  # the step thread runs what was queued, then stops
    assert "run stream closed; dropped 2 sequence(s)" in caplog.text
    assert not servicer.leader.rank.held.seqs
