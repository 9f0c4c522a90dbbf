"""1,000 requests of random lengths through a fake pipeline at P = 1, 2 and 4.

The fake model's next token is a hash of the sequence's history read back through the block
table (see fake_pipeline.py), so every sequence, preempted, forked or not, must produce exactly
the tokens of the block-free reference. Also checked: in-flight steps never share a sequence
(P consecutive ones with run-ahead), new requests start in arrival order and the first in line
waits a bounded time (so none waits without bound), preemptions of decoding sequences, forks
with block copies and late finishes did happen, and nothing is held at the end.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from router.scheduler import ChoiceSpec, FinishReason, StepPlan
from tests.router.scheduler.driver import EOS, VOCAB, check_plan_protocol, make_scheduler
from tests.router.scheduler.fake_pipeline import reference_tokens

NUM_REQUESTS = 1000
MAX_TOKENS = 40


@dataclass(frozen=True)
class SimRequest:
    seq_id: int
    prompt: list[int]
    max_tokens: int
    choice_ids: tuple[int, ...]


@dataclass
class SimReport:
    ticks: int = 0
    first_scheduled: dict[int, int] = field(default_factory=dict)
    arrived: dict[int, int] = field(default_factory=dict)
    start_order: list[int] = field(default_factory=list)
    head_ticks: dict[int, int] = field(default_factory=dict)  # ticks spent first in line
    preempted_after_decoding: int = 0
    discarded_tokens: int = 0
    block_copies: int = 0
    max_outstanding: int = 0


def make_requests(rng: random.Random) -> list[SimRequest]:
    bases = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 40))] for _ in range(6)]
    requests = []
    for i in range(NUM_REQUESTS):
        if rng.random() < 0.5:
            suffix = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 20))]
            prompt = [*rng.choice(bases), *suffix]
        else:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))]
        choices = rng.choice([(), (), (), (), (), (10_000 + i,), (10_000 + i, 20_000 + i)])
        requests.append(SimRequest(i, prompt, rng.randint(1, MAX_TOKENS), choices))
    return requests


def _check_disjoint(plan: StepPlan, outstanding: deque[StepPlan], window: int | None) -> None:
    ids = set(plan.seq_ids)
    for other in outstanding:
        if window is None or plan.step_id - other.step_id < window:
            assert not ids & set(other.seq_ids), (
                f"steps {other.step_id} and {plan.step_id} share {ids & set(other.seq_ids)}")


def simulate(pipeline_depth: int, run_ahead: bool, seed: int = 0,
             depths: tuple[int, ...] = ()) -> SimReport:
    """`depths`: with run-ahead, the run-ahead depth is set to one of them, at random,
    before every tick (as the engine core paces it); the config allows the largest."""
    rng = random.Random(seed)
    pace = random.Random(seed + 1)
    requests = make_requests(rng)
    limits = {r.seq_id: r.max_tokens for r in requests}
    limits.update({c: r.max_tokens for r in requests for c in r.choice_ids})
    scheduler, pipeline = make_scheduler(
        num_blocks=96, block_size=4, max_num_batched_tokens=64, max_num_seqs=16,
        max_model_len=128, max_inflight_steps=pipeline_depth, run_ahead=run_ahead,
        run_ahead_depth=max(depths, default=2))
    window = pipeline_depth if run_ahead else None  # P consecutive steps share no sequence
    report = SimReport()
    outputs: dict[int, list[int]] = {sid: [] for sid in limits}
    arrivals = deque(requests)
    outstanding: deque[StepPlan] = deque()
    while arrivals or scheduler.has_unfinished or outstanding:
        report.ticks += 1
        assert report.ticks < 200_000, "the simulation does not drain"
        for _ in range(rng.randint(0, 3)):
            if arrivals:
                req = arrivals.popleft()
                scheduler.add_request(req.seq_id, req.prompt, req.seq_id,
                                      extra_choices=[ChoiceSpec(c, c) for c in req.choice_ids])
                report.arrived[req.seq_id] = report.ticks
        if depths:
            scheduler.run_ahead_depth = pace.choice(depths)
        plan = scheduler.schedule()
        if plan is not None:
            check_plan_protocol(plan)
            _check_disjoint(plan, outstanding, window)
            _record(plan, report, outputs)
            outstanding.append(plan)
            report.max_outstanding = max(report.max_outstanding, len(outstanding))
        head = len(report.start_order)  # requests start in arrival order (asserted below)
        if head in report.arrived and head not in report.first_scheduled:
            report.head_ticks[head] = report.head_ticks.get(head, 0) + 1
        if outstanding and (plan is None or not scheduler.has_capacity):
            done = outstanding.popleft()
            update = scheduler.update(done.step_id, pipeline.execute(done))
            report.discarded_tokens += len(update.discarded_seq_ids)
            for seq_id, token in update.new_tokens.items():
                out = outputs[seq_id]
                out.append(token)
                if (token == EOS or len(out) >= limits[seq_id]) and (
                        seq_id not in update.length_capped_seq_ids):
                    scheduler.finish(seq_id, FinishReason.STOP)
        if report.ticks % 97 == 0:
            scheduler.check_integrity()
    scheduler.check_integrity()
    assert scheduler.kv_cache.usage().num_used_blocks == 0
    for req in requests:
        for seq_id in (req.seq_id, *req.choice_ids):
            expected = reference_tokens(req.prompt, seq_id, VOCAB, req.max_tokens, EOS)
            assert outputs[seq_id] == expected, f"sequence {seq_id} diverged"
    return report


def _record(plan: StepPlan, report: SimReport, outputs: dict[int, list[int]]) -> None:
    for new in plan.new_seqs:
        if new.seq_id not in report.first_scheduled:
            report.first_scheduled[new.seq_id] = report.ticks
            if new.seq_id < NUM_REQUESTS:
                report.start_order.append(new.seq_id)
    report.preempted_after_decoding += sum(1 for s in plan.preempted_seq_ids if outputs[s])
    report.block_copies += len(plan.block_copies)


@pytest.mark.parametrize("run_ahead", [False, True], ids=["plain", "run_ahead"])
@pytest.mark.parametrize("pipeline_depth", [1, 2, 4])
def test_thousand_requests_complete_with_reference_tokens(pipeline_depth: int,
                                                          run_ahead: bool) -> None:
    report = simulate(pipeline_depth, run_ahead)
    assert report.start_order == list(range(NUM_REQUESTS)), "a request was overtaken"
    # Arrivals outpace service on purpose (to force preemption), so the queue is long; what
    # must stay bounded is the wait of the request first in line. It starts once the running
    # set makes room: a running sequence ends within MAX_TOKENS + 2 prefill chunks of its own
    # steps, and its steps come round every max_outstanding_steps ticks (x1.5 for preemptions).
    outstanding_steps = pipeline_depth * (2 if run_ahead else 1)
    bound = (MAX_TOKENS + 2) * 3 // 2 * outstanding_steps
    assert max(report.head_ticks.values()) <= bound, "the first in line waited too long"
    assert report.preempted_after_decoding > 0, "no decoding sequence was ever preempted"
    assert report.block_copies > 0, "no choice forked off a partial block"
    if run_ahead:
        assert report.discarded_tokens > 0, "no finish was learned late"


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_a_run_ahead_depth_changed_between_steps_keeps_every_token(pipeline_depth: int) -> None:
    """The engine core deepens and shallows run-ahead as the pipeline's pace changes
    (`router.core.pace`): steps planned at a depth the scheduler has since left behind are
    answered as usual, and every sequence still produces exactly its reference tokens."""
    report = simulate(pipeline_depth, run_ahead=True, depths=(2, 3, 8))
    assert report.start_order == list(range(NUM_REQUESTS)), "a request was overtaken"
    assert report.discarded_tokens > 0, "no finish was learned late"
    assert report.max_outstanding > 3 * pipeline_depth, "never deeper than depth 3"
