"""The engine core's run-ahead pace (`router.core.pace`): the configured depth at any pace,
deeper only while the steps planned ahead run within the budget."""

from __future__ import annotations

import pytest

from router.core.config import CoreConfig
from router.core.pace import MIN_INTERVALS, RunAheadPace
from router.scheduler import Scheduler
from tests.router.scheduler.driver import make_scheduler


def _paced(budget_ms: float = 20.0, base: int = 4, micro_batches: int = 2,
           run_ahead: bool = True) -> tuple[RunAheadPace, Scheduler]:
    cfg = CoreConfig(model_dir="", stage_addresses=(), input_address="",
                     run_ahead_depth=base, run_ahead_budget_ms=budget_ms)
    scheduler, _ = make_scheduler(max_inflight_steps=micro_batches, run_ahead=run_ahead,
                                  run_ahead_depth=cfg.max_run_ahead_depth)
    return RunAheadPace(scheduler, base, budget_ms / 1e3), scheduler


def _answers(pace: RunAheadPace, interval_s: float, count: int, start: float = 100.0) -> float:
    """`count` answers `interval_s` apart, each with steps still out; returns the last time."""
    now = start
    for _ in range(count):
        pace.answered(now, still_outstanding=True)
        now += interval_s
    return now - interval_s


def test_the_depth_is_the_configured_one_until_the_pace_is_measured() -> None:
    pace, scheduler = _paced()
    assert scheduler.config.run_ahead_depth == 8  # the most: twice --run-ahead-depth
    assert scheduler.run_ahead_depth == 4
    _answers(pace, 0.0005, MIN_INTERVALS)  # MIN_INTERVALS answers are MIN_INTERVALS - 1 gaps
    assert scheduler.run_ahead_depth == 4
    pace.answered(200.0, still_outstanding=True)
    assert scheduler.run_ahead_depth == 4  # the gap since the last answer is 100 s


@pytest.mark.parametrize(("interval_ms", "depth"), [
    (10.0, 4),  # a GPU's step: 2 x 4 steps take 80 ms, past the budget: the base
    (2.0, 5),  # 2 micro-batches x 5 steps x 2 ms = 20 ms
    (1.0, 8),  # 10 would fit; 8 is the most
    (0.1, 8),
])
def test_steps_answered_faster_plan_deeper_within_the_budget(interval_ms: float,
                                                             depth: int) -> None:
    pace, scheduler = _paced(budget_ms=20.0)
    _answers(pace, interval_ms / 1e3, 50)
    assert scheduler.run_ahead_depth == depth
    assert pace.interval_s == pytest.approx(interval_ms / 1e3)
    assert scheduler.outstanding_limit == 2 * depth  # every sequence decodes


def test_a_waiting_request_still_caps_what_is_planned_at_two_steps_per_micro_batch() -> None:
    pace, scheduler = _paced()
    _answers(pace, 0.0005, 50)
    assert scheduler.run_ahead_depth == 8
    scheduler.add_request(1, [5, 6], None)
    assert scheduler.outstanding_limit == 4


def test_the_depth_follows_the_pace_down_again() -> None:
    pace, scheduler = _paced()
    now = _answers(pace, 0.0005, 50)
    assert scheduler.run_ahead_depth == 8
    _answers(pace, 0.020, 60, start=now + 0.020)
    assert scheduler.run_ahead_depth == 4


def test_time_with_nothing_outstanding_is_not_a_step() -> None:
    """An answer after which no step was out starts no interval: the time to the next one
    was a wait for work (an idle pipeline), not the pipeline's pace."""
    pace, scheduler = _paced()
    now = 100.0
    for _ in range(50):
        pace.answered(now, still_outstanding=False)
        now += 0.0005
    assert pace.interval_s == 0.0 and scheduler.run_ahead_depth == 4


def test_a_budget_of_zero_keeps_the_configured_depth() -> None:
    pace, scheduler = _paced(budget_ms=0.0)
    assert scheduler.config.run_ahead_depth == 4
    _answers(pace, 0.0001, 50)
    assert scheduler.run_ahead_depth == 4


def test_reset_goes_back_to_the_configured_depth() -> None:
    pace, scheduler = _paced()
    _answers(pace, 0.0005, 50)
    assert scheduler.run_ahead_depth == 8
    pace.reset()
    assert scheduler.run_ahead_depth == 4 and pace.interval_s == 0.0
    _answers(pace, 0.0005, MIN_INTERVALS)
    assert scheduler.run_ahead_depth == 4  # measured afresh before it moves


def test_without_run_ahead_the_pace_leaves_the_scheduler_alone() -> None:
    pace, scheduler = _paced(run_ahead=False)
    _answers(pace, 0.0005, 50)
    pace.reset()
    assert scheduler.outstanding_limit == 2  # one step per micro-batch


def test_the_scheduler_refuses_a_depth_outside_its_range() -> None:
    _, scheduler = _paced()
    for depth in (1, 9):
        with pytest.raises(ValueError, match=r"run_ahead_depth must be in \[2, 8\], got"):
            scheduler.run_ahead_depth = depth
    plain, _ = make_scheduler()
    with pytest.raises(ValueError, match="only with run-ahead"):
        plain.run_ahead_depth = 2


def test_room_sends_steps_in_bursts_of_half_the_limit() -> None:
    """The core plans when nothing is out, or when half the steps allowed are free (or a
    group's worth, where answers come in smaller groups; not here, the budget is large):
    at depth 8 and 2 micro-batches, 8 steps go out at a time."""
    pace, scheduler = _paced(budget_ms=160.0)
    _answers(pace, 0.0005, 50)
    assert pace.answer_group > 8
    for seq_id in range(1, 9):
        scheduler.add_request(seq_id, [seq_id], None)
    prefill = scheduler.schedule()
    assert prefill is not None
    scheduler.update(prefill.step_id, dict.fromkeys(prefill.seq_ids, 7))  # all decode now
    assert pace.room() and scheduler.outstanding_limit == 16
    planned = []
    while (plan := scheduler.schedule()) is not None:
        planned.append(plan)
    assert len(planned) == 16 and not pace.room()
    for plan in planned[:7]:  # 9 out: fewer than half the 16 are free
        scheduler.update(plan.step_id, dict.fromkeys(plan.seq_ids, 7))
    assert not pace.room()
    scheduler.update(planned[7].step_id, dict.fromkeys(planned[7].seq_ids, 7))
    assert pace.room()


def test_a_message_of_answers_paces_as_the_steps_it_answers() -> None:
    """The last stage answers the steps done together (or held, `hold_answer`) in one
    message: the time since the message before is that many steps'. Sixteen answers every
    8 ms pace at 0.5 ms a step, not at the 8 ms between messages."""
    pace, scheduler = _paced()
    now = 100.0
    for _ in range(40):
        pace.answered(now, still_outstanding=True, count=16)
        now += 0.008
    assert pace.interval_s == pytest.approx(0.0005)
    assert scheduler.run_ahead_depth == 8


@pytest.mark.parametrize(("interval_ms", "group"), [
    (10.0, 1),  # a GPU's step: answered as soon as it is done
    (2.0, 2),  # 1/8 of the 20 ms budget is 2.5 ms: one step's answer may wait for the next
    (0.4, 7),  # 6 more steps fit in the 2.5 ms
])
def test_answers_wait_for_later_steps_only_while_steps_are_short(interval_ms: float,
                                                                   group: int) -> None:
    pace, _ = _paced()
    assert pace.holds(8) == [False] * 8  # the pace is not measured yet
    _answers(pace, interval_ms / 1e3, 50)
    assert pace.answer_group == group
    holds = pace.holds(8)
    assert holds[-1] is False  # the last plan sent: nothing queued behind it to wait for
    assert [i for i, hold in enumerate(holds) if not hold] == sorted(
        {*range(group - 1, 8, group), 7})
    pace.reset()
    assert pace.answer_group == 1 and pace.holds(3) == [False] * 3


def test_while_answers_come_in_groups_the_core_plans_a_group_at_a_time() -> None:
    """The core learns of a group's steps when its last one is done: it plans as soon as a
    group's worth of steps is free, not half the limit, so the stages' queues do not run
    dry behind the steps whose answers waited."""
    pace, scheduler = _paced()
    _answers(pace, 0.0004, 50)
    assert pace.answer_group == 7 and scheduler.outstanding_limit == 16
    for seq_id in range(1, 9):
        scheduler.add_request(seq_id, [seq_id], None)
    prefill = scheduler.schedule()
    assert prefill is not None
    scheduler.update(prefill.step_id, dict.fromkeys(prefill.seq_ids, 7))
    planned = []
    while (plan := scheduler.schedule()) is not None:
        planned.append(plan)
    assert len(planned) == 16 and not pace.room()
    for plan in planned[:6]:
        scheduler.update(plan.step_id, dict.fromkeys(plan.seq_ids, 7))
    assert not pace.room()
    scheduler.update(planned[6].step_id, dict.fromkeys(planned[6].seq_ids, 7))
    assert pace.room()  # 7 free, a group's worth (half the limit would be 8)
