"""Lanes in a one-stage pipeline (`Lanes(on_device=True)`), which overlaps its steps
(`StageLeader.step_overlapped`): a step applied before the step it continues is resolved
gets placeholders that the record fills, and its inputs are the ids that step left on the
device. The same plans through a stage with lanes off must end in the same state, with the
same inputs computed and the same tokens sampled, whichever steps were left pending."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from protos.stagemesh.stage.v1 import stage_pb2 as pb
from router.pipeline.convert import plans_to_protos
from router.scheduler import CachedSeq, NewSeq, StepPlan
from stage_worker.build import build_stage_rank
from stage_worker.config import StageConfig
from stage_worker.convert import plan_from_proto
from stage_worker.leader import StageLeader
from stage_worker.parallel import TPGroup
from stage_worker.plan import StageOutcome, StagePlan
from stage_worker.step_input import SeqChunk
from tests.default_model import default_model_dir


def _received(plan: StepPlan) -> StagePlan:
    """The one stage's plan as it converts it after the wire."""
    msg = plans_to_protos([plan], 1)[0]
    return plan_from_proto(pb.StepPlans.FromString(msg.SerializeToString()).plans[0])


class _Stage:
    """A one-stage null pipeline's leader, lanes on or off, that records what each step
    computed (its chunks and input ids), what it delivered, and how often a lane went on."""

    def __init__(self, lanes: bool) -> None:
        cfg = StageConfig(default_model_dir(), stage_index=0, num_stages=1, model_impl="null",
                          step_timeout_s=5.0)
        self.leader = StageLeader(build_stage_rank(cfg, TPGroup()), step_timeout_s=5.0)
        rank = self.leader.rank
        assert self.leader.overlaps and rank.lanes.on_device
        rank.lanes.enabled = lanes
        self.computed: list[tuple[list[SeqChunk], list[int]]] = []
        self.delivered: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        self.continued = 0
        execute, apply = rank.runner.execute, rank.lanes.apply

        def recorded(chunks: list[SeqChunk], inputs: torch.Tensor, fill: object = None
                     ) -> object:
            self.computed.append((list(chunks), inputs.tolist()))
            return execute(chunks, inputs, fill)  # type: ignore[arg-type]

        def counted(*args: object) -> object:
            self.continued += 1
            return apply(*args)  # type: ignore[arg-type]
        rank.runner.execute = recorded  # type: ignore[method-assign,assignment]
        rank.lanes.apply = counted  # type: ignore[method-assign,assignment]

    def step(self, plan: StepPlan, more_coming: bool) -> None:
        def deliver(outcome: StageOutcome) -> None:
            self.delivered.append((outcome.step_id, outcome.seq_ids, outcome.token_ids))
        self.leader.step_overlapped(_received(plan), deliver, lambda: more_coming)

    def flush(self) -> None:
        self.leader.flush(lambda o: self.delivered.append((o.step_id, o.seq_ids, o.token_ids)))

    def state(self) -> object:
        held = self.leader.rank.held
        return ({s: (h.token_ids, h.output_ids, h.block_table, h.num_outputs,
                     h.last_sample_step) for s, h in held.seqs.items()},
                dict(held.block_refs), dict(held._unfilled), self.computed, self.delivered)


def _decodes(step: int, starts: dict[int, int], from_step: int | None,
             blocks: dict[int, tuple[int, ...]] | None = None,
             tokens: dict[int, int] | None = None) -> StepPlan:
    """One-token decodes of `starts` (seq_id -> position), run-ahead from `from_step` or
    with `tokens` appended, `blocks` opened by some."""
    blocks, tokens = blocks or {}, tokens or {}
    return StepPlan(step, (), tuple(
        CachedSeq(s, blocks.get(s, ()), start, 1, (tokens[s],) if s in tokens else (),
                  None if s in tokens else from_step, True)
        for s, start in starts.items()))


@pytest.mark.parametrize("pending", ["always", "never", "alternating"])
def test_one_batch_continued_ends_where_checked_steps_do(pending: str) -> None:
    """One micro-batch: each step continues the step just before it, left pending
    (`always`: its tokens still on the device), resolved (`never`), or either in turn."""
    on, off = _Stage(lanes=True), _Stage(lanes=False)
    prompts = {5: list(range(100, 114)), 6: list(range(200, 215)), 7: [300, 301, 302]}
    pos = {s: len(p) for s, p in prompts.items()}
    plans = [StepPlan(0, tuple(NewSeq(s, tuple(p), len(p), None, (i,), 0, len(p), True)
                               for i, (s, p) in enumerate(prompts.items())), ())]
    for step in range(1, 12):
        opens = {2: {6: (10,)}, 3: {5: (11,)}}.get(step, {})  # position 16: a new block
        plans.append(_decodes(step, {s: pos[s] + step - 1 for s in pos}, step - 1, opens))
    for i, plan in enumerate(plans):
        more = {"always": True, "never": False, "alternating": i % 2 == 0}[pending]
        for stage in (on, off):
            stage.step(plan, more and i < len(plans) - 1)
        assert on.state() == off.state(), f"step {plan.step_id}"
    for stage in (on, off):
        stage.flush()
    assert on.state() == off.state()
    assert [d[0] for d in on.delivered] == list(range(12))
    for step in range(1, 12):  # each decode's inputs: the tokens the step before sampled
        assert on.computed[step][1] == list(on.delivered[step - 1][2]), f"step {step}"
    assert on.continued == 10  # steps 2-11 continue the lane step 1 left
    assert not on.leader.rank.held._unfilled  # every placeholder filled by its record


def test_two_batches_continue_their_own_resolved_steps() -> None:
    """Two micro-batches in turn, each step run-ahead from its batch's step two before
    (resolved: only the step just before is pending), one step with tokens appended."""
    on, off = _Stage(lanes=True), _Stage(lanes=False)
    prompts = {1: [10, 11, 12], 2: [20, 21, 22, 23], 3: [30, 31], 4: [40, 41, 42, 43, 44]}
    batches = ({1: 3, 2: 4}, {3: 2, 4: 5})
    plans = [StepPlan(b, tuple(NewSeq(s, tuple(prompts[s]), len(prompts[s]), None, (s,), 0,
                                      len(prompts[s]), True) for s in batch), ())
             for b, batch in enumerate(batches)]
    for step in range(2, 14):
        batch, n = batches[step % 2], step // 2
        plans.append(_decodes(step, {s: start + n - 1 for s, start in batch.items()},
                              step - 2))
    for i, plan in enumerate(plans):
        for stage in (on, off):
            stage.step(plan, i < len(plans) - 1)
        assert on.state() == off.state(), f"step {plan.step_id}"
    for stage in (on, off):
        stage.flush()
    assert on.state() == off.state()
    assert on.continued == 10


def test_a_continuation_with_its_tokens_appended_keeps_the_lane() -> None:
    on, off = _Stage(lanes=True), _Stage(lanes=False)
    plans: list[StepPlan] = [StepPlan(0, (NewSeq(9, (1, 2, 3), 3, None, (0,), 0, 3, True),), ())]
    plans.append(_decodes(1, {9: 3}, 0))
    stages: list[Callable[[StepPlan, bool], None]] = [on.step, off.step]
    for plan in plans:
        for run in stages:
            run(plan, False)
    sampled = {9: on.delivered[-1][2][0]}
    assert sampled == {9: off.delivered[-1][2][0]}
    for plan in (_decodes(2, {9: 4}, None, tokens=sampled), _decodes(3, {9: 5}, 2)):
        for run in stages:
            run(plan, True)
        assert on.state() == off.state(), f"step {plan.step_id}"
    for stage in (on, off):
        stage.flush()
    assert on.state() == off.state()
    assert on.continued == 2
