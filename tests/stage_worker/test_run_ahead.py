"""Run-ahead on the stages: the router's scheduler (run_ahead=True) drives 1, 2 and 3
in-process stage servicers over the real data plane, so plans name "the token sampled at
step k" as inputs (taken by the first stage from its own result, or from the last stage's
feedback link; a single stage queues step k+1 before step k's tokens reach its host).
The same plans with those inputs written out as appended tokens, replayed on fresh stage
state, give exactly the same tokens and logprobs. A small KV pool makes the
scheduler preempt, so re-prefilled sequences (penalties, seeded draws) are covered too."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from foundation.sampling_params import SamplingParams
from kvcache import KVCacheConfig
from router.pipeline import Pipeline, StepOutcome
from router.scheduler import CachedSeq, FinishReason, Scheduler, SchedulerConfig, StepPlan
from tests.stage_worker.serving import stage_configs, start_stage
from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint

BLOCK, MAX_TOKENS = 8, 10
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.3, logprobs=2),
    SamplingParams(temperature=0.0, presence_penalty=0.8, frequency_penalty=0.4),
    SamplingParams(temperature=1.2, top_k=20, seed=9),
    SamplingParams(temperature=0.7, top_p=0.9, seed=1, logprobs=0),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama_gqa_untied")
    write_tiny_checkpoint("llama_gqa_untied", path)
    return path


def _scheduler(micro_batches: int, depth: int) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
                             max_inflight_steps=micro_batches, run_ahead=True,
                             run_ahead_depth=depth)
    # 8 blocks of 8 for 5 sequences of 5 to 21 + 10 tokens: some get preempted.
    scheduler = Scheduler(config, KVCacheConfig(num_blocks=8, block_size=BLOCK,
                                                enable_prefix_caching=False))
    for i, params in enumerate(PARAMS):
        prompt = [(7 * i + 3 * j) % 160 for j in range(5 + 4 * i)]
        scheduler.add_request(100 + i, prompt, params)
    return scheduler


async def _drive(pipeline: Pipeline, scheduler: Scheduler
                 ) -> tuple[list[StepPlan], dict[int, StepOutcome], int]:
    """Plan while the scheduler has room (ahead of results; the plans made together go in
    one message, as the engine core sends them), apply results as they come; every
    sequence ends after MAX_TOKENS tokens. Also returns the most steps outstanding."""
    most_outstanding = 0
    outcomes: asyncio.Queue[StepOutcome] = asyncio.Queue()
    pipeline.on_outcome = outcomes.put_nowait
    plans: list[StepPlan] = []
    results: dict[int, StepOutcome] = {}
    generated: dict[int, int] = {}
    while scheduler.has_unfinished:
        ready = []
        while scheduler.has_capacity and (plan := scheduler.schedule()) is not None:
            ready.append(plan)
        if ready:
            plans += ready
            most_outstanding = max(most_outstanding, scheduler.num_outstanding_steps)
            await pipeline.send(ready)
        outcome = await asyncio.wait_for(outcomes.get(), 30)
        results[outcome.step_id] = outcome
        for seq_id in scheduler.update(outcome.step_id, outcome.tokens).new_tokens:
            generated[seq_id] = generated.get(seq_id, 0) + 1
            if generated[seq_id] == MAX_TOKENS:
                scheduler.finish(seq_id, FinishReason.LENGTH)
    while len(results) < len(plans):  # steps of late finishes: answered all the same
        outcome = await asyncio.wait_for(outcomes.get(), 30)
        results[outcome.step_id] = outcome
    return plans, results, most_outstanding


def _written_out(plan: StepPlan, results: dict[int, StepOutcome]) -> StepPlan:
    """`plan` with every run-ahead input given as the token its step sampled."""
    cached = tuple(
        s if s.input_from_step is None else
        CachedSeq(s.seq_id, s.new_block_ids, s.num_computed_tokens, s.num_new_tokens,
                  (results[s.input_from_step].tokens[s.seq_id],), None, s.sample)
        for s in plan.cached_seqs)
    return StepPlan(plan.step_id, plan.new_seqs, cached, plan.finished_seq_ids,
                    plan.aborted_seq_ids, plan.preempted_seq_ids, plan.block_copies)


async def _replay(pipeline: Pipeline, plans: list[StepPlan]) -> dict[int, StepOutcome]:
    outcomes: asyncio.Queue[StepOutcome] = asyncio.Queue()
    pipeline.on_outcome = outcomes.put_nowait
    for plan in plans:
        await pipeline.send([plan])
    got = [await asyncio.wait_for(outcomes.get(), 30) for _ in plans]
    return {o.step_id: o for o in got}


# (stages, depth, micro-batches): fewer micro-batches than stages is how stages that share
# a GPU run, each step planned on the one just before it.
@pytest.mark.parametrize(("num_stages", "depth", "micro"),
                         [(1, 2, 1), (2, 2, 2), (3, 2, 3), (1, 4, 1), (2, 4, 2), (2, 4, 1),
                          (3, 2, 1)])
def test_run_ahead_gives_the_tokens_of_the_same_plans_written_out(checkpoint: Path,
                                                                  num_stages: int,
                                                                  depth: int,
                                                                  micro: int) -> None:
    configs = stage_configs(checkpoint, num_stages, block_size=BLOCK, num_blocks=32,
                            max_num_batched_tokens=64, max_num_seqs=4, step_timeout_s=20.0)

    overlapped: list[int] = []

    async def body() -> tuple[list[StepPlan], dict[int, StepOutcome], dict[int, StepOutcome],
                              list[str], int]:
        stages = [await start_stage(c) for c in configs]
        leader = stages[0].servicer.leader
        pipeline = Pipeline([s.address for s in stages])
        failures: list[str] = []
        pipeline.on_failure = failures.append
        try:
            await pipeline.start(10)
            plans, results, most = await _drive(pipeline, _scheduler(micro, depth))
            overlapped.append(leader.steps_overlapped)
            await pipeline.start(10)  # a new epoch and Run: the stages start empty
            replayed = await _replay(pipeline, [_written_out(p, results) for p in plans])
            return plans, results, replayed, failures, most
        finally:
            await pipeline.close(drain=False)
            for stage in stages:
                await stage.stop()

    plans, results, replayed, failures, most_outstanding = asyncio.run(body())
    assert failures == []
    ahead = [s for p in plans for s in p.cached_seqs if s.input_from_step is not None]
    assert len(ahead) >= 10  # run-ahead was exercised, and so was preemption:
    if depth > 2:  # more steps outstanding than one planned on another allows
        assert most_outstanding > 2 * micro
    assert any(p.preempted_seq_ids for p in plans)
    if num_stages == 1:  # steps queued behind a pending one, run-ahead inputs read on device
        assert overlapped[0] > 0
    assert sorted(replayed) == sorted(results) == [p.step_id for p in plans]
    for step_id, outcome in results.items():
        assert replayed[step_id].tokens == outcome.tokens, step_id
        assert replayed[step_id].logprobs == outcome.logprobs, step_id
    assert any(o.logprobs for o in results.values())
