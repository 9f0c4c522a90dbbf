"""The StageService servicer in-process: a real grpc.aio server on 127.0.0.1 in the test's
event loop, over a single-stage pipeline built from a tiny random checkpoint (and one with
the null runner). Tokens are compared with the offline pipeline's greedy ones. Refusals and
failures are in test_stage_service_errors.py."""


from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest
import torch

from protos.stagemesh.stage.v1 import stage_pb2 as pb
from router.pipeline.convert import cached_batch_to_proto
from router.scheduler import CachedSeq
from stage_worker.config import StageConfig
from stage_worker.offline import LocalPipeline, LocalPipelineConfig, greedy_generate
from tests.stage_worker.stage_service_harness import (
    BLOCK,
    BLOCKS,
    MAX_NEW,
    MAX_SEQS,
    MAX_TOKENS,
    RunStream,
    decodes,
    prefill,
    run_plans,
    sampled,
    service_checkpoint,
    serving,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return service_checkpoint(tmp_path_factory)


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

    messages = _answers_in_one_write(cfg, plans)
    results = [r for m in messages for r in m.results]
    assert [r.step_id for r in results] == list(range(MAX_NEW))
    assert not any(r.error for r in results)
    got = [[t for r in results for s, t in sampled(r) if s == seq_id] for seq_id in (4, 5)]
    assert got == want
    assert len(messages) <= len(results)


@pytest.mark.parametrize("hold_last", [False, True])
def test_held_answers_go_out_with_a_later_steps_answer(checkpoint: Path,
                                                      hold_last: bool) -> None:
    """Plans that say `hold_answer` are answered in one message with the first step after
    them that does not (or, where every plan says it, with the last step queued when the
    stream ends): one message for the run here, the same tokens."""
    cfg = StageConfig(checkpoint, model_impl="null", max_num_batched_tokens=4096)
    plans = [prefill([7], [[1, 2, 3]], [[0, 1]])]
    plans += [decodes(step, [(7, 2 + step, 7 + step - 1)]) for step in range(1, 6)]
    for plan in plans[:-1] if not hold_last else plans:
        plan.hold_answer = True

    messages = _answers_in_one_write(cfg, plans)
    assert len(messages) == 1
    assert [sampled(r) for r in messages[0].results] == [[(7, 7 + k)] for k in range(6)]


def test_held_answers_go_out_with_a_later_steps_failure(checkpoint: Path) -> None:
    """A step refused on the worker after steps whose answers were held: the held answers
    and its error, in order, in one message, and the steps behind it skipped."""
    cfg = StageConfig(checkpoint, model_impl="null", max_num_batched_tokens=4096)
    plans = [prefill([7], [[1, 2, 3]], [[0, 1]]), decodes(1, [(7, 3, 7)]),
             decodes(2, [(99, 3, 1)]), decodes(3, [(7, 4, 8)])]
    for plan in plans:
        plan.hold_answer = True

    messages = _answers_in_one_write(cfg, plans)
    assert len(messages) == 1
    results = messages[0].results
    assert [sampled(r) for r in results[:2]] == [[(7, 7)], [(7, 8)]]
    assert results[2].step_id == 2 and "sequence 99 is not held" in results[2].error
    assert len(results) == 3


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


def _answers_in_one_write(cfg: StageConfig, plans: list[pb.StepPlan]) -> list[pb.StepResults]:
    """The messages a stage serving `cfg` answers to `plans` sent in one message (the stream
    closed after it), within 30 s."""

    async def body() -> list[pb.StepResults]:
        async with serving(cfg) as stub:
            call = stub.Run()
            await call.write(pb.StepPlans(plans=plans))
            await call.done_writing()
            return [m async for m in call]

    return asyncio.run(asyncio.wait_for(body(), 30))
