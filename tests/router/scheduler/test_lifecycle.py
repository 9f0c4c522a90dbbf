"""Admission, validation, abort in every state, result validation, preemption by recompute."""

from __future__ import annotations

import pytest

from router.scheduler import (
    AdmissionRefusedError,
    ChoiceSpec,
    DuplicateSeqIdError,
    FinishReason,
    InvalidRequestError,
    InvalidStepResultError,
    RefusalReason,
    SeqState,
)
from tests.router.scheduler.driver import EOS, VOCAB, Driver, make_scheduler
from tests.router.scheduler.fake_pipeline import reference_tokens


def test_admission_limits_refuse_with_a_typed_error_naming_the_limit() -> None:
    scheduler, _ = make_scheduler(max_queued_requests=2, max_queued_tokens=10)
    scheduler.add_request(1, [1, 2, 3], None)
    scheduler.add_request(2, [1, 2, 3], None)
    with pytest.raises(AdmissionRefusedError, match="limit is 2") as refused:
        scheduler.add_request(3, [1], None)
    assert refused.value.reason is RefusalReason.QUEUED_REQUESTS
    assert (refused.value.limit, refused.value.current) == (2, 2)
    plan = scheduler.schedule()  # both start: the queue empties
    assert plan is not None and scheduler.num_waiting == 0
    with pytest.raises(AdmissionRefusedError) as refused:
        scheduler.add_request(3, list(range(11)), None)
    assert refused.value.reason is RefusalReason.QUEUED_TOKENS
    assert refused.value.requested == 11
    scheduler.add_request(3, list(range(10)), None)
    assert scheduler.get_state(3) is SeqState.WAITING


def test_invalid_requests_are_refused_as_invalid() -> None:
    scheduler, _ = make_scheduler(max_model_len=8, max_num_seqs=2)
    with pytest.raises(InvalidRequestError, match="empty"):
        scheduler.add_request(1, [], None)
    with pytest.raises(InvalidRequestError, match="limit is 7"):
        scheduler.add_request(1, list(range(8)), None)
    with pytest.raises(InvalidRequestError, match="choices"):
        scheduler.add_request(1, [1], None, extra_choices=[ChoiceSpec(i, None) for i in (2, 3)])
    scheduler.add_request(1, [1], None)
    with pytest.raises(DuplicateSeqIdError):
        scheduler.add_request(1, [1], None)
    with pytest.raises(DuplicateSeqIdError):
        scheduler.add_request(2, [1], None, extra_choices=[ChoiceSpec(2, None)])
    assert scheduler.num_waiting == 1


def test_update_rejects_a_mismatched_result_and_changes_nothing() -> None:
    scheduler, _ = make_scheduler()
    scheduler.add_request(1, [1, 2], None)
    scheduler.add_request(2, [3, 4], None)
    plan = scheduler.schedule()
    assert plan is not None
    for step_id, sampled in ((5, {1: 0, 2: 0}), (0, {1: 0}), (0, {1: 0, 2: 0, 3: 0})):
        with pytest.raises(InvalidStepResultError):
            scheduler.update(step_id, sampled)
        scheduler.check_integrity()
    assert scheduler.get_token_ids(1) == (1, 2)
    assert dict(scheduler.update(0, {1: 8, 2: 9}).new_tokens) == {1: 8, 2: 9}
    with pytest.raises(InvalidStepResultError):
        scheduler.update(0, {1: 8, 2: 9})  # answered already


@pytest.mark.parametrize("where", ["waiting", "in_flight_prefill", "running_idle", "preempted",
                                   "pending_choice", "finished", "unknown"])
def test_abort_in_any_state_frees_exactly_once(where: str) -> None:
    scheduler, pipeline = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    driver = Driver(scheduler, pipeline)
    target = 1
    scheduler.add_request(1, list(range(12)), 0, extra_choices=[ChoiceSpec(2, 2)])
    scheduler.add_request(3, [5, 6], 3)
    if where != "waiting":
        driver.plan()  # 1 prefills 8 of its 11 shared tokens; 3 waits for budget
    if where == "running_idle":
        driver.complete()
    if where == "preempted":
        driver.complete()
        scheduler.preempt_all()
    if where == "pending_choice":
        target = 2
    if where == "finished":
        scheduler.abort(1)
    if where == "unknown":
        target = 99
    expect_live = where not in ("finished", "unknown")
    assert scheduler.abort(target) is expect_live
    assert not scheduler.abort(target)
    scheduler.check_integrity()
    driver.run()  # everything else completes, the stages are told, nothing is held
    freed = [i for p in driver.plans for i in p.freed_seq_ids]
    assert len(freed) == len(set(freed)), "a sequence was freed twice on the stages"
    assert scheduler.kv_cache.usage().num_used_blocks == 0
    scheduler.check_integrity()


def test_newest_running_sequence_is_preempted_and_resumes_with_identical_tokens() -> None:
    scheduler, pipeline = make_scheduler(num_blocks=6, block_size=2, max_model_len=12,
                                         max_num_batched_tokens=16, max_num_seqs=4)
    driver = Driver(scheduler, pipeline, max_tokens={1: 7, 2: 7}, use_eos=False)
    prompts = {1: [1, 2, 3], 2: [4, 5, 6]}
    for seq_id, prompt in prompts.items():
        scheduler.add_request(seq_id, prompt, seq_id)
    driver.run()
    preempting = [p for p in driver.plans if p.preempted_seq_ids]
    assert preempting and preempting[0].preempted_seq_ids == (2,)  # the newer one
    first = preempting[0]
    assert 2 not in first.seq_ids  # never sent as new in the plan that frees it
    resumed = next(s for p in driver.plans[first.step_id + 1:] for s in p.new_seqs
                   if s.seq_id == 2)
    expected = {i: reference_tokens(p, i, VOCAB, 7, None) for i, p in prompts.items()}
    generated = len(resumed.token_ids) - 3
    assert generated > 0  # it had decoded: the history goes back in full
    assert resumed.token_ids == (4, 5, 6, *expected[2][:generated])
    assert resumed.prompt_len == 3  # the history holds outputs too; the prompt is 3 of it
    for seq_id in prompts:
        assert driver.outputs[seq_id] == expected[seq_id]
    assert scheduler.stats().num_preemptions >= 1


def test_preempt_all_requeues_everything_and_refuses_results_of_lost_steps() -> None:
    scheduler, pipeline = make_scheduler(max_inflight_steps=2, max_num_seqs=2)
    driver = Driver(scheduler, pipeline, max_tokens={i: 6 for i in range(1, 5)})
    for seq_id in range(1, 5):
        scheduler.add_request(seq_id, [seq_id, 1, 2, 3, 4], seq_id)
    for _ in range(6):
        driver.tick()
    lost = list(driver.outstanding)
    assert lost, "steps must be in flight when the stage goes down"
    running = scheduler.num_running
    assert scheduler.preempt_all() == running
    usage = scheduler.kv_cache.usage()
    assert usage.num_used_blocks == 0 and usage.num_hashed_blocks == 0
    with pytest.raises(InvalidStepResultError):
        scheduler.update(lost[0].step_id, {})
    driver.outstanding.clear()
    pipeline.restart(scheduler.stats().num_steps)
    scheduler.check_integrity()
    notice = driver.plan()  # tells the stages first; nothing resumes in the same plan
    assert notice is not None and notice.seq_ids == ()
    assert sorted(notice.preempted_seq_ids) == [1, 2, 3, 4]
    driver.run()
    for seq_id in range(1, 5):
        prompt = [seq_id, 1, 2, 3, 4]
        assert driver.outputs[seq_id] == reference_tokens(prompt, seq_id, VOCAB, 6, EOS)


def test_a_step_that_preempts_admits_nobody() -> None:
    scheduler, _ = make_scheduler(num_blocks=4, block_size=2, max_model_len=8)
    scheduler.add_request(1, [1, 2, 3], None)
    scheduler.add_request(2, [4, 5, 6], None)
    for step in range(2):  # prefill, then one decode each: blocks 0-3 all in use
        plan = scheduler.schedule()
        assert plan is not None
        scheduler.update(step, {1: 0, 2: 0})
    scheduler.add_request(3, [9], None, priority=-1)  # first in line; would fit in a freed block
    plan = scheduler.schedule()
    assert plan is not None and plan.preempted_seq_ids == (2,)
    assert plan.seq_ids == (1,) and plan.cached_seqs[0].new_block_ids == (3,)
    assert scheduler.get_state(3) is SeqState.WAITING


def test_prefill_chunks_are_cached_as_soon_as_they_are_sent() -> None:
    scheduler, _ = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    prompt = list(range(30, 42))
    scheduler.add_request(1, prompt, None)
    scheduler.schedule()  # chunk [0, 8): two full blocks; the next chunk leaves room
    scheduler.update(0, {})
    scheduler.add_request(2, [*prompt[:8], 1], None)
    plan = scheduler.schedule()
    assert plan is not None
    (new,) = plan.new_seqs
    assert (new.seq_id, new.num_computed_tokens) == (2, 8)


def test_settled_until_a_step_is_out_or_a_finish_waits_for_a_plan() -> None:
    """`settled`: nothing outstanding and nothing the stages are yet to learn. A finish of
    a sequence the stages hold leaves a notice that only a plan clears."""
    scheduler, _ = make_scheduler()
    assert scheduler.settled
    scheduler.add_request(1, [1, 2, 3], None)
    plan = scheduler.schedule()
    assert plan is not None and not scheduler.settled  # the step is out
    scheduler.update(plan.step_id, {1: 5})
    assert scheduler.settled
    scheduler.finish(1, FinishReason.STOP)
    assert not scheduler.settled  # the stages still hold sequence 1
    notice = scheduler.schedule()
    assert notice is not None and notice.finished_seq_ids == (1,) and not notice.seq_ids
    assert not scheduler.settled  # sent, not yet answered
    scheduler.update(notice.step_id, {})
    assert scheduler.settled
