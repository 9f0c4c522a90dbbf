"""The pipeline driver against real in-process stage servicers (null model): the shape it
derives from Describe, what each stage is sent, how a result is read, and a restarted stage
that came back smaller.
"""

from __future__ import annotations

import asyncio
import re
import sys
from array import array
from dataclasses import replace
from pathlib import Path

import pytest

from foundation.ports import free_port
from foundation.sampling_params import SamplingParams
from protos.stagemesh.stage.v1 import stage_pb2 as pb
from router.outputs import TokenLogprob
from router.pipeline import Pipeline, PipelineError
from router.pipeline.convert import outcome_from_result, plans_to_protos, sampling_to_proto
from router.scheduler import CachedSeq, NewSeq, StepPlan
from stage_worker.sampling import noise_seed
from tests.default_model import default_model_dir
from tests.stage_worker.serving import stage_configs, start_stage


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


def test_each_stage_gets_what_it_reads() -> None:
    plan = StepPlan(
        step_id=7,
        new_seqs=(NewSeq(seq_id=1, token_ids=(5, 6, 7), prompt_len=3,
                         sampling=SamplingParams(temperature=0.0, seed=3), block_ids=(0,),
                         num_computed_tokens=0, num_new_tokens=3, sample=True),),
        cached_seqs=(CachedSeq(2, (4,), 16, 1, (9,), None, True),
                     CachedSeq(4, (), 20, 1, (), 5, True),  # run-ahead: input from step 5
                     CachedSeq(1 << 41, (6, 8), 0, 12, (), None, False)),  # a prefill chunk
        finished_seq_ids=(3,))
    first, middle, last = (m.plans[0] for m in plans_to_protos([plan], 3))
    for msg in (first, last):
        assert list(msg.new_seqs[0].token_ids) == [5, 6, 7]
        assert msg.new_seqs[0].sampling.seed == 3
        assert _columns(msg.cached_batch) == {
            "seq_ids": [2, 4, 1 << 41], "num_computed": [16, 20, 0], "num_new": [1, 1, 12],
            "flags": [1, 3, 0], "input_from_step": [5], "new_block_counts": [1, 0, 2],
            "new_block_ids": [4, 6, 8], "append_token_counts": [1, 0, 0],
            "append_token_ids": [9]}
    assert list(middle.new_seqs[0].token_ids) == [] and not middle.new_seqs[0].HasField(
        "sampling")
    assert _columns(middle.cached_batch) == {  # no tokens, no run-ahead steps
        "seq_ids": [2, 4, 1 << 41], "num_computed": [16, 20, 0], "num_new": [1, 1, 12],
        "flags": [1, 1, 0], "input_from_step": [], "new_block_counts": [1, 0, 2],
        "new_block_ids": [4, 6, 8], "append_token_counts": [0, 0, 0], "append_token_ids": []}
    for msg in (first, middle, last):  # what every stage needs
        assert msg.step_id == 7 and list(msg.free_seq_ids) == [3]
        assert list(msg.new_seqs[0].block_ids) == [0] and msg.new_seqs[0].prompt_len == 3
    assert [m.plans[0] for m in plans_to_protos([plan], 1)] == [first]


def _columns(batch: pb.CachedBatch) -> dict[str, list[int]]:
    """Each column of a CachedBatch unpacked (little-endian; the item types of stage.proto)."""
    typecodes = {"seq_ids": "q", "num_computed": "i", "num_new": "i", "flags": "B",
                 "input_from_step": "q", "new_block_counts": "i", "new_block_ids": "i",
                 "append_token_counts": "i", "append_token_ids": "q"}
    columns = {}
    for name, typecode in typecodes.items():
        values = array(typecode)
        values.frombytes(getattr(batch, name))
        if sys.byteorder != "little":
            values.byteswap()
        columns[name] = values.tolist()
    return columns


def _result(step_id: int, seq_ids: list[int], token_ids: list[int],
            logprobs: list[pb.SampledToken] | None = None) -> pb.StepResult:
    return pb.StepResult(step_id=step_id, tokens=logprobs or [],
                         sampled_seq_ids=array("q", seq_ids).tobytes(),
                         sampled_token_ids=array("q", token_ids).tobytes())


@pytest.mark.parametrize("seed", [0, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63)])
def test_a_seed_reaches_the_stages_as_the_int64_that_draws_alike(seed: int) -> None:
    # Any seed SamplingParams accepts ([-2**63, 2**64)) fits the stage proto's int64.
    sent = sampling_to_proto(SamplingParams(temperature=1.0, seed=seed)).seed
    assert -(2**63) <= sent < 2**63 and (sent - seed) % 2**64 == 0
    assert [noise_seed(sent, k) for k in range(4)] == [noise_seed(seed, k) for k in range(4)]


def test_a_result_decodes_to_tokens_and_only_the_asked_logprobs() -> None:
    record = pb.SampledToken(seq_id=9, token_id=-3, logprob=-0.5, top_token_ids=[4, -3],
                             top_logprobs=[-0.25, -0.5])
    outcome = outcome_from_result(_result(12, [7, 9, 1 << 40], [5, -3, 2**63 - 1], [record]))
    assert outcome.step_id == 12
    assert outcome.tokens == {7: 5, 9: -3, 1 << 40: 2**63 - 1}
    assert outcome.logprobs == {9: TokenLogprob(-3, -0.5, ((4, -0.25), (-3, -0.5)))}
    assert outcome_from_result(_result(13, [], [])).tokens == {}


@pytest.mark.parametrize(("result", "error"), [
    (_result(4, [1, 2], [3]), "step 4: the last stage sent 2 sequence ids and 1 tokens"),
    (pb.StepResult(step_id=5, sampled_seq_ids=b"\0" * 12, sampled_token_ids=b"\0" * 8),
     "step 5: sampled_seq_ids holds 12 bytes, not whole int64s"),
    (_result(6, [1, 1], [3, 4]), "step 6: the last stage sampled a sequence twice"),
    (_result(7, [1], [3], [pb.SampledToken(seq_id=1, token_id=4)]),
     "step 7: a logprob record names token 4 of sequence 1, which was not sampled"),
], ids=["lengths", "bytes", "repeated", "logprob-token"])
def test_a_malformed_result_is_a_pipeline_error_naming_the_step(result: pb.StepResult,
                                                                error: str) -> None:
    with pytest.raises(PipelineError, match=re.escape(error)):
        outcome_from_result(result)


def test_shape_is_the_minimum_and_names_the_limiting_stage(model_dir: Path) -> None:
    base = stage_configs(model_dir, 3, model_impl="null", num_blocks=400)
    configs = [base[0], replace(base[1], num_blocks=100, max_num_seqs=32),
               replace(base[2], max_num_batched_tokens=1024)]

    async def run() -> None:
        stages = [await start_stage(c) for c in configs]
        pipeline = Pipeline([s.address for s in stages])
        try:
            shape = await pipeline.start(10)
            assert (shape.num_kv_blocks, shape.max_num_seqs, shape.max_num_batched_tokens) \
                == (100, 32, 1024)
            assert shape.limiting_stage == {"num_kv_blocks": 1, "max_num_seqs": 1,
                                            "max_num_batched_tokens": 2}
            assert shape.model_impl == "null" and shape.num_stages == 3
        finally:
            await pipeline.close()
            for stage in stages:
                await stage.stop()

    asyncio.run(run())


def test_a_stage_that_comes_back_smaller_is_refused(model_dir: Path) -> None:
    configs = [replace(c, port=free_port())
               for c in stage_configs(model_dir, 2, model_impl="null", num_blocks=400)]

    async def run() -> None:
        stages = [await start_stage(c) for c in configs]
        pipeline = Pipeline([s.address for s in stages])
        try:
            await pipeline.start(10)
            await stages[1].stop()  # "restarted" with a smaller pool on the same address
            stages[1] = await start_stage(replace(configs[1], num_blocks=100))
            with pytest.raises(PipelineError, match=r"stage 1 now reports num_kv_blocks 100, "
                                                    r"the pipeline was started with 400"):
                await pipeline.start(5.0)
            await stages[1].stop()  # back at its old size: accepted
            stages[1] = await start_stage(configs[1])
            assert (await pipeline.start(10)).num_kv_blocks == 400
        finally:
            await pipeline.close()
            for stage in stages:
                await stage.stop()

    asyncio.run(run())


def test_stages_out_of_order_are_refused(model_dir: Path) -> None:
    configs = stage_configs(model_dir, 2, model_impl="null", num_blocks=64)

    async def run() -> None:
        stages = [await start_stage(c) for c in configs]
        pipeline = Pipeline([stages[1].address, stages[0].address])
        try:
            with pytest.raises(PipelineError, match="reports itself as stage 1 of 2, "
                                                    "expected 0 of 2"):
                await pipeline.start(0.5)
        finally:
            await pipeline.close(drain=False)
            for stage in stages:
                await stage.stop()

    asyncio.run(run())
