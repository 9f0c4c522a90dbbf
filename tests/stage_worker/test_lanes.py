"""Steady decode continued in columns (`stage_worker.lanes`): a stage that continues a lane
ends every step exactly where the full check and apply would (the same tokens sampled, the
same held state on every stage), and a continuation that differs from its lane in any way
the check looks at goes through the check, which refuses it as before."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from itertools import pairwise

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
from stage_worker.plan import PlanError, StagePlan, SteadyBatch
from stage_worker.stage_rank import StageRank
from stage_worker.step_input import SeqChunk
from tests.default_model import default_model_dir

TOKEN = b"l" * 32
BLOCK = 16  # the null stage's block size (StageConfig's default)


def _received(plan: StepPlan, num_stages: int) -> list[StagePlan]:
    """Every stage's plan as it converts it after the wire."""
    return [plan_from_proto(pb.StepPlans.FromString(msg.SerializeToString()).plans[0])
            for msg in plans_to_protos([plan], num_stages)]


def _decodes(step: int, starts: dict[int, int], from_step: int | None = None,
             blocks: dict[int, tuple[int, ...]] | None = None,
             tokens: dict[int, int] | None = None, **notices: tuple[int, ...]) -> StepPlan:
    """A step of one-token decodes of `starts` (seq_id -> position), run-ahead from
    `from_step` or with `tokens` appended, `blocks` opened by some."""
    blocks, tokens = blocks or {}, tokens or {}
    return StepPlan(step, (), tuple(
        CachedSeq(s, blocks.get(s, ()), start, 1, (tokens[s],) if s in tokens else (),
                  None if s in tokens else from_step, True)
        for s, start in starts.items()), **notices)  # type: ignore[arg-type]


# --- the conversion --------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["run-ahead", "appended"])
def test_a_steady_batch_stays_columns_and_reads_as_its_tuples(form: str) -> None:
    starts = {4: 30, 9: 31, 2: 16}
    plan = (_decodes(7, starts, 5, {2: (40,)}) if form == "run-ahead"
            else _decodes(7, starts, tokens={4: 11, 9: 12, 2: 13}))
    first, middle, last = _received(plan, 3)
    for got, tokens in ((first, True), (middle, False), (last, True)):
        assert isinstance(got.cached_seqs, SteadyBatch)
        assert got.num_tokens == 3 and got.num_seqs == 3
        want = tuple((c.seq_id, c.new_block_ids, c.num_computed_tokens, 1,
                      c.new_token_ids if tokens else (), True,
                      c.input_from_step if tokens else None) for c in plan.cached_seqs)
        assert tuple(got.cached_seqs) == want and got.cached_seqs == want


def test_decodes_from_several_steps_are_not_a_steady_batch() -> None:
    plan = StepPlan(7, (), (CachedSeq(1, (), 9, 1, (), 3, True),
                            CachedSeq(2, (), 9, 1, (), 4, True)))
    assert all(type(p.cached_seqs) is tuple for p in _received(plan, 2))


# --- whole steps through linked leaders, lanes on and off -------------------------------------


def _leader(stage_index: int, num_stages: int, lanes: bool) -> StageLeader:
    cfg = StageConfig(default_model_dir(), stage_index=stage_index, num_stages=num_stages,
                      model_impl="null", step_timeout_s=5.0)
    leader = StageLeader(build_stage_rank(cfg, TPGroup()), step_timeout_s=5.0)
    leader.rank.lanes.enabled = lanes
    return leader


def _linked(num_stages: int, lanes: bool, stack: ExitStack) -> list[StageLeader]:
    leaders = [_leader(i, num_stages, lanes) for i in range(num_stages)]
    for leader in leaders:  # each step's chunks and (first stage) input ids, as computed
        runner, execute = leader.rank.runner, leader.rank.runner.execute
        runner.computed = []  # type: ignore[attr-defined]

        def recorded(chunks: list[SeqChunk], inputs: torch.Tensor, fill: object = None, *,
                     _execute: object = execute, _runner: object = runner) -> object:
            out = _execute(chunks, inputs, fill)  # type: ignore[operator]
            ids = inputs.tolist() if inputs.dtype == torch.int64 else None
            _runner.computed.append((list(chunks), ids))  # type: ignore[attr-defined]
            return out
        runner.execute = recorded  # type: ignore[method-assign,assignment]
    for leader in leaders:
        stack.callback(leader.shutdown)
    for up, down in pairwise(leaders):
        up.connect_downstream(down.listen_upstream("127.0.0.1", TOKEN, 0), TOKEN, 0)
    leaders[-1].connect_feedback(leaders[0].listen_feedback("127.0.0.1", TOKEN, 0), TOKEN, 0)
    deadline = time.monotonic() + 5
    while not (leaders[0].links.has_feedback and all(x.linked for x in leaders)):
        assert time.monotonic() < deadline, "links"
        time.sleep(0.01)
    return leaders


def _state(rank: StageRank) -> object:
    """What the stage holds, and every step it computed."""
    held = rank.held
    return ({s: (h.token_ids, h.output_ids, h.block_table, h.num_outputs, h.last_sample_step)
             for s, h in held.seqs.items()}, dict(held.block_refs), dict(held._unfilled),
            rank.runner.computed)  # type: ignore[attr-defined]


@pytest.fixture(params=[2, 3], ids=["2-stages", "3-stages"])
def pipelines(request: pytest.FixtureRequest
              ) -> Iterator[tuple[list[StageLeader], list[StageLeader], list[int]]]:
    """Two linked pipelines of null stages, lanes on and off, and a count of continuations."""
    with ExitStack() as stack:
        on, off = _linked(request.param, True, stack), _linked(request.param, False, stack)
        continued = [0]
        for leader in on:
            lanes, apply = leader.rank.lanes, leader.rank.lanes.apply

            def counted(*args: object, _apply: object = apply) -> object:
                continued[0] += 1
                return _apply(*args)  # type: ignore[operator]
            lanes.apply = counted  # type: ignore[method-assign,assignment]
        yield on, off, continued


def _run(leaders: list[StageLeader], plan: StepPlan) -> dict[int, int]:
    outcome = None
    for leader, stage_plan in zip(leaders, _received(plan, len(leaders)), strict=True):
        outcome = leader.run_step(stage_plan)
    assert outcome is not None
    return outcome.sampled


def test_continued_steps_end_where_checked_steps_do(
        pipelines: tuple[list[StageLeader], list[StageLeader], list[int]]) -> None:
    on, off, continued = pipelines
    prompts = {5: list(range(100, 114)), 6: list(range(200, 215)), 7: [300, 301, 302]}
    pos = {s: len(p) for s, p in prompts.items()}  # the position each computes next
    sampled: dict[int, int] = {}

    def step(plan: StepPlan) -> None:
        nonlocal sampled
        sampled = _run(on, plan)
        assert sampled == _run(off, plan), f"step {plan.step_id}"
        for a, b in zip(on, off, strict=True):
            assert _state(a.rank) == _state(b.rank), f"step {plan.step_id}"
        for c in plan.cached_seqs:
            pos[c.seq_id] += 1

    step(StepPlan(0, tuple(NewSeq(s, tuple(p), len(p), None, (i,), 0, len(p), True)
                           for i, (s, p) in enumerate(prompts.items())), ()))
    step(_decodes(2, dict(pos), 0))  # checked in full: its batch becomes a lane
    step(_decodes(4, dict(pos), 2, {6: (3,)}))  # sequence 6 opens a block
    step(_decodes(6, dict(pos), 4, {5: (4,)}))
    step(_decodes(8, dict(pos), tokens=dict(sampled)))  # the router had the tokens
    step(_decodes(10, dict(pos), 8))
    del pos[7]  # sequence 7 ended: a new batch, checked in full, a lane again
    step(_decodes(12, dict(pos), 10, finished_seq_ids=(7,)))
    step(_decodes(14, dict(pos), 12))
    assert continued[0] == 5 * len(on)  # steps 4, 6, 8, 10 and 14, on every stage


# --- continuations that differ from their lane ------------------------------------------------


class _Twins:
    """One stage (index `stage` of 2) twice, lanes on and off, given the same plans; the last
    stage's sampling is played by hand (token 7 for everyone)."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        cfg = StageConfig(default_model_dir(), stage_index=stage, num_stages=2,
                          model_impl="null")
        self.on, self.off = (build_stage_rank(cfg, TPGroup()) for _ in range(2))
        self.off.lanes.enabled = False

    def plans(self, plan: StepPlan) -> tuple[StagePlan, StagePlan]:
        return _received(plan, 2)[self.stage], _received(plan, 2)[self.stage]

    def run(self, plan: StepPlan) -> None:
        for rank, stage_plan in zip((self.on, self.off), self.plans(plan), strict=True):
            rank.check(stage_plan)
            if rank.is_first:
                rank.step(stage_plan, None, {}, late=lambda seqs, steps: [7] * len(seqs))
            else:
                fed = {c.seq_id: rank.held.seqs[c.seq_id].output_ids[-1]
                       for c in stage_plan.cached_seqs if c.input_from_step is not None}
                if rank.continues_lane(stage_plan):
                    fed = {}
                upstream = torch.zeros(stage_plan.num_tokens, rank.shape.hidden_size,
                                       dtype=rank.shape.dtype)
                chunks, _ = rank.step(stage_plan, upstream, fed)
                sampled = tuple(c.seq_id for c in chunks if c.sample)
                rank.held.note_sampling(plan.step_id, sampled)
                rank.held.record_sampled(plan.step_id, sampled, [7] * len(sampled))

    def check(self, plan: StepPlan) -> tuple[bool, str, str]:
        """Whether the lanes' rank continued a lane, and what each rank's check said."""
        said = []
        on_plan, off_plan = self.plans(plan)
        for rank, stage_plan in ((self.on, on_plan), (self.off, off_plan)):
            try:
                rank.check(stage_plan)
                said.append("accepted")
            except PlanError as e:
                said.append(str(e))
        return self.on.continues_lane(on_plan), said[0], said[1]


PROMPTS = {5: tuple(range(100, 114)), 6: tuple(range(200, 215))}


def _lane_made(stage: int) -> _Twins:
    """Both ranks after a prefill (step 0) and a decode (step 2) whose batch is a lane."""
    twins = _Twins(stage)
    twins.run(StepPlan(0, tuple(NewSeq(s, p, len(p), None, (i,), 0, len(p), True)
                                for i, (s, p) in enumerate(PROMPTS.items())), ()))
    twins.run(_decodes(2, {5: 14, 6: 15}, 0))
    return twins


@pytest.mark.parametrize("stage", [0, 1], ids=["first", "last"])
def test_the_exact_continuation_continues_the_lane(stage: int) -> None:
    twins = _lane_made(stage)
    assert twins.check(_decodes(4, {5: 15, 6: 16}, 2, {6: (3,)})) == (True, "accepted",
                                                                      "accepted")


@pytest.mark.parametrize(("stage", "before", "plan", "said"), [
    (0, None, _decodes(4, {5: 15, 6: 17}, 2, {6: (3,)}),  # not its positions
     "step 4, sequence 6: the first stage knows 17 tokens, the step computes up to token 18"),
    (0, None, _decodes(4, {6: 16, 5: 15}, 2, {6: (3,)}), "accepted"),  # another order
    (1, None, _decodes(4, {5: 15, 6: 16}, 1, {6: (3,)}),  # not its step
     "step 4, sequence 5 takes its input from step 1, but this stage last sampled it at "
     "step 2"),
    (0, StepPlan(3, (), (), finished_seq_ids=(6,)), _decodes(4, {5: 15, 6: 16}, 2, {6: (3,)}),
     "step 4, sequence 6 is not held by this stage"),  # freed since
    (0, StepPlan(3, (NewSeq(6, PROMPTS[6], 15, None, (9,), 0, 15, False),), (),
                 preempted_seq_ids=(6,)),
     _decodes(4, {5: 15, 6: 16}, 2, {6: (3,)}),  # freed and sent again
     "step 4, sequence 6: the first stage knows 16 tokens, the step computes up to token 17"),
    (0, None, _decodes(4, {5: 15, 6: 16}, 2),  # its table is full, and no block comes
     "step 4, sequence 6: 1 blocks cannot hold 17 tokens (block size 16)"),
    (0, None, _decodes(4, {5: 15, 6: 16}, 2, {6: (1 << 16,)}),
     "step 4, sequence 6: block id 65536 is outside this stage's KV pool [0, 65536) "
     "(num_blocks 65536)"),
    (0, None, _decodes(4, {5: 15, 6: 16}, 2, {6: (3,)}, finished_seq_ids=(9,)),
     "accepted"),  # with a free in it
    (1, "sampled", _decodes(4, {5: 15, 6: 16}, 2, {6: (3,)}),  # sampled again since
     "step 4, sequence 5 takes its input from step 2, but this stage last sampled it at "
     "step 3"),
], ids=["positions", "order", "step", "freed", "sent-again", "table-full", "outside-pool",
        "with-a-free", "sampled-since"])
def test_a_continuation_that_differs_is_checked_as_before(
        stage: int, before: StepPlan | str | None, plan: StepPlan, said: str) -> None:
    twins = _lane_made(stage)
    if isinstance(before, StepPlan):
        twins.run(before)
    elif before == "sampled":  # a step 3 that sampled sequence 5 (no router sends one)
        for rank in (twins.on, twins.off):
            rank.held.note_sampling(3, (5,))
    assert twins.check(plan) == (False, said, said)


def test_a_cpu_stage_writes_a_lanes_input_ids_into_one_kept_tensor() -> None:
    """Consecutive continuations of one lane on a CPU first stage fill the same tensor, each
    with its own step's tokens (the runner reads it within the step)."""
    twins = _lane_made(0)
    rank = twins.on
    seen: list[tuple[torch.Tensor, list[int]]] = []
    execute = rank.runner.execute

    def recorded(chunks: list[SeqChunk], inputs: torch.Tensor, fill: object = None) -> object:
        out = execute(chunks, inputs, fill)  # type: ignore[arg-type]
        seen.append((inputs, inputs.tolist()))
        return out
    rank.runner.execute = recorded  # type: ignore[method-assign,assignment]
    for step, (tokens, starts) in enumerate((((7, 8), {5: 15, 6: 16}),
                                             ((9, 10), {5: 16, 6: 17}))):
        plan = twins.plans(_decodes(4 + 2 * step, starts, 2 + 2 * step,
                                    {6: (3,)} if step == 0 else {5: (4,)}))[0]
        rank.check(plan)
        assert rank.continues_lane(plan)
        rank.step(plan, None, {}, late=lambda seqs, steps, t=tokens: list(t))
    assert seen[0][0] is seen[1][0]
    assert [ids for _, ids in seen] == [[7, 8], [9, 10]]
