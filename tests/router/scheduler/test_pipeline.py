"""Pipeline micro-batches and run-ahead."""

from __future__ import annotations

import pytest

from router.scheduler import CachedSeq, FinishReason, InvalidStepResultError
from tests.router.scheduler.driver import make_scheduler


def test_p_steps_in_flight_over_disjoint_balanced_sequence_sets() -> None:
    scheduler, _ = make_scheduler(max_inflight_steps=2, max_num_seqs=4)
    for seq_id in range(1, 5):
        scheduler.add_request(seq_id, [seq_id, seq_id], None)
    first = scheduler.schedule()
    assert first is not None and first.seq_ids == (1, 2, 3, 4)
    assert scheduler.schedule() is None  # all four in flight: nothing else to do
    scheduler.update(first.step_id, dict.fromkeys(first.seq_ids, 5))
    a, b = scheduler.schedule(), scheduler.schedule()
    assert a is not None and b is not None
    assert a.seq_ids == (1, 2) and b.seq_ids == (3, 4)  # ceil(4 / P) decodes per step
    assert scheduler.schedule() is None and not scheduler.has_capacity
    with pytest.raises(InvalidStepResultError, match="oldest outstanding step is 1"):
        scheduler.update(b.step_id, {3: 0, 4: 0})
    scheduler.update(a.step_id, {1: 0, 2: 0})
    c = scheduler.schedule()
    assert c is not None and c.seq_ids == (1, 2)  # 3 and 4 are still in flight
    scheduler.check_integrity()


def test_run_ahead_names_the_token_sampled_at_the_previous_step() -> None:
    scheduler, _ = make_scheduler(block_size=4, run_ahead=True)
    scheduler.add_request(1, [10, 11, 12], None)
    prefill = scheduler.schedule()
    ahead = scheduler.schedule()  # before the prefill's token came back
    assert prefill is not None and ahead is not None
    assert ahead.cached_seqs == (CachedSeq(1, (), 3, 1, (), 0, True),)
    assert scheduler.schedule() is None  # depth one: two steps of P = 1 outstanding
    assert dict(scheduler.update(0, {1: 20}).new_tokens) == {1: 20}
    nxt = scheduler.schedule()  # position 4 needs block 1; input sampled at step 1
    assert nxt is not None
    assert nxt.cached_seqs == (CachedSeq(1, (1,), 4, 1, (), 1, True),)
    scheduler.update(1, {1: 21})
    scheduler.update(2, {1: 22})
    assert scheduler.get_token_ids(1) == (10, 11, 12, 20, 21, 22)
    plan = scheduler.schedule()  # no step outstanding: the input is known again
    assert plan is not None and plan.cached_seqs[0].new_token_ids == (22,)
    scheduler.check_integrity()


def test_a_finish_learned_late_discards_the_surplus_token_and_gives_back_its_slot() -> None:
    scheduler, _ = make_scheduler(block_size=2, run_ahead=True)
    scheduler.add_request(1, [10, 11], None)
    scheduler.schedule()
    ahead = scheduler.schedule()
    assert ahead is not None and ahead.cached_seqs[0].input_from_step == 0
    assert ahead.cached_seqs[0].new_block_ids == (1,)  # slot 2 opened a block
    scheduler.update(0, {1: 2})  # say 2 is EOS: the caller finishes it now
    assert scheduler.finish(1, FinishReason.STOP)
    assert scheduler.kv_cache.usage().num_used_blocks == 0  # both blocks back at once
    update = scheduler.update(1, {1: 3})  # the surplus token
    assert update.new_tokens == {} and update.discarded_seq_ids == (1,)
    plan = scheduler.schedule()
    assert plan is not None and plan.finished_seq_ids == (1,)
    scheduler.check_integrity()


def test_run_ahead_keeps_p_consecutive_steps_disjoint() -> None:
    scheduler, _ = make_scheduler(max_inflight_steps=2, max_num_seqs=2, run_ahead=True)
    for seq_id in (1, 2, 3, 4):
        scheduler.add_request(seq_id, [seq_id], None)
    plans = [scheduler.schedule() for _ in range(4)]
    assert all(p is not None for p in plans)
    ids = [p.seq_ids for p in plans if p is not None]
    assert ids == [(1, 2), (3, 4), (1, 2), (3, 4)]  # again only P = 2 steps later
    assert [s.input_from_step for p in plans[2:] if p for s in p.cached_seqs] == [0, 0, 1, 1]
    assert scheduler.schedule() is None  # 2 * P outstanding
    scheduler.check_integrity()


def test_run_ahead_is_full_depth_only_while_every_sequence_decodes() -> None:
    """Depth 4 at P = 1: four decode steps may be outstanding; while a request waits, or a
    step with prompt work is outstanding, two (a new arrival is planned within two steps,
    not behind four planned before it came)."""
    scheduler, _ = make_scheduler(block_size=4, run_ahead=True, run_ahead_depth=4)
    scheduler.add_request(1, [10, 11, 12], None)
    assert scheduler.outstanding_limit == 2  # a request waits
    prefill = scheduler.schedule()
    assert prefill is not None and scheduler.outstanding_limit == 2  # its prefill is out
    assert scheduler.schedule() is not None and scheduler.schedule() is None
    scheduler.update(prefill.step_id, {1: 20})
    assert scheduler.outstanding_limit == 4  # only decodes are out now
    steps = [scheduler.schedule() for _ in range(4)]
    assert all(s is not None for s in steps[:3]) and steps[3] is None  # 4 outstanding
    scheduler.add_request(2, [13, 14], None)
    assert scheduler.outstanding_limit == 2 and not scheduler.has_capacity
    for step_id in range(1, 4):  # the planned steps drain; then request 2 joins
        scheduler.update(step_id, {1: 21 + step_id})
    joined = scheduler.schedule()
    assert joined is not None and [s.seq_id for s in joined.new_seqs] == [2]
    scheduler.check_integrity()
