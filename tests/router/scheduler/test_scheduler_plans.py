"""Exact plans: chunked prefill, diffs, budgets, ordering, prefix reuse, finish notices."""

from __future__ import annotations

import pytest

from kvcache import KVCacheConfig
from router.scheduler import (
    CachedSeq,
    FinishReason,
    NewSeq,
    Scheduler,
    SchedulerConfig,
    SeqState,
)
from tests.router.scheduler.driver import make_scheduler


def test_prefill_is_chunked_and_only_the_last_chunk_samples() -> None:
    scheduler, _ = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8,
                                  max_num_seqs=4)
    prompt = list(range(100, 120))  # 20 tokens: chunks of 8, 8, 4
    scheduler.add_request(1, prompt, "greedy")
    plan = scheduler.schedule()
    assert plan is not None and plan.step_id == 0 and plan.cached_seqs == ()
    assert plan.new_seqs == (NewSeq(1, tuple(prompt), 20, "greedy", (0, 1), 0, 8, False),)
    assert scheduler.schedule() is None  # P = 1: one step at a time
    assert scheduler.update(0, {}).new_tokens == {}
    plan = scheduler.schedule()
    assert plan is not None
    # The stages hold the whole prompt already: later chunks send no tokens.
    assert plan.cached_seqs == (CachedSeq(1, (2, 3), 8, 8, (), None, False),)
    scheduler.update(1, {})
    plan = scheduler.schedule()
    assert plan is not None
    assert plan.cached_seqs == (CachedSeq(1, (4,), 16, 4, (), None, True),)
    assert plan.sampling_seq_ids == (1,)
    update = scheduler.update(2, {1: 77})
    assert dict(update.new_tokens) == {1: 77}
    plan = scheduler.schedule()  # decode of the sampled token at position 20: a new block
    assert plan is not None
    assert plan.cached_seqs == (CachedSeq(1, (5,), 20, 1, (77,), None, True),)
    scheduler.update(3, {1: 78})
    plan = scheduler.schedule()
    assert plan is not None and plan.cached_seqs[0].new_block_ids == ()
    scheduler.check_integrity()


def test_finish_frees_at_once_and_the_next_plan_tells_the_stages_once() -> None:
    scheduler, _ = make_scheduler()
    scheduler.add_request(1, [1, 2, 3], None)
    scheduler.add_request(2, [4, 5, 6], None)
    plan = scheduler.schedule()
    assert plan is not None and plan.seq_ids == (1, 2)
    scheduler.update(0, {1: 9, 2: 9})
    assert scheduler.finish(1, FinishReason.STOP)
    assert scheduler.abort(2)
    assert scheduler.kv_cache.usage().num_used_blocks == 0
    assert not scheduler.finish(1, FinishReason.STOP) and not scheduler.abort(2)
    plan = scheduler.schedule()  # nothing to compute, but the stages must hear of it
    assert plan is not None and plan.seq_ids == ()
    assert (plan.finished_seq_ids, plan.aborted_seq_ids) == ((1,), (2,))
    scheduler.update(plan.step_id, {})
    assert scheduler.schedule() is None
    assert not scheduler.has_unfinished


def test_one_finish_reason_with_the_openai_values() -> None:
    assert {r.name: r.value for r in FinishReason} == {
        "STOP": "stop", "LENGTH": "length", "ABORT": "abort"}
    scheduler, _ = make_scheduler()
    for seq_id in (1, 2, 3):
        scheduler.add_request(seq_id, [seq_id, 1], None)
    plan = scheduler.schedule()
    assert plan is not None
    scheduler.update(plan.step_id, dict.fromkeys(plan.sampling_seq_ids, 9))
    assert scheduler.finish(1, FinishReason.STOP) and scheduler.finish(2, FinishReason.LENGTH)
    assert scheduler.finish(3, FinishReason.ABORT)
    plan = scheduler.schedule()
    assert plan is not None
    assert (plan.finished_seq_ids, plan.aborted_seq_ids) == ((1, 2), (3,))


def test_decodes_first_then_prefill_chunks_then_waiting_within_one_budget() -> None:
    scheduler, _ = make_scheduler(max_num_batched_tokens=6, max_num_seqs=3)
    scheduler.add_request(1, [1, 2], None)
    plan = scheduler.schedule()
    assert plan is not None
    scheduler.update(0, {1: 5})  # 1 now decodes
    scheduler.add_request(2, list(range(10)), None)
    scheduler.add_request(3, [7, 7], None)
    plan = scheduler.schedule()  # decode 1 (1 token), then 2 takes the other 5
    assert plan is not None
    assert [(s.seq_id, s.num_new_tokens) for s in plan.cached_seqs] == [(1, 1)]
    assert [(s.seq_id, s.num_new_tokens) for s in plan.new_seqs] == [(2, 5)]
    scheduler.update(plan.step_id, {1: 5})
    plan = scheduler.schedule()  # decode 1, chunk of 2 (5 left: budget 5), 3 waits
    assert plan is not None
    assert [(s.seq_id, s.num_new_tokens, s.sample) for s in plan.cached_seqs] == [
        (1, 1, True), (2, 5, True)]
    assert plan.new_seqs == ()
    assert scheduler.get_state(3) is SeqState.WAITING


def test_priority_first_then_arrival_order() -> None:
    scheduler, _ = make_scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    scheduler.add_request(1, [1], None, priority=1)
    scheduler.add_request(2, [2], None)
    scheduler.add_request(3, [3], None)
    started = []
    while scheduler.has_unfinished:
        plan = scheduler.schedule()
        assert plan is not None
        started += [s.seq_id for s in plan.new_seqs]
        update = scheduler.update(plan.step_id, dict.fromkeys(plan.sampling_seq_ids, 9))
        for seq_id in update.new_tokens:
            scheduler.finish(seq_id, FinishReason.STOP)
    assert started == [2, 3, 1]


def test_second_request_sharing_a_three_block_prefix_computes_only_its_new_tokens() -> None:
    scheduler, _ = make_scheduler(num_blocks=16, block_size=4)
    prefix = list(range(200, 212))  # 3 full blocks
    scheduler.add_request(1, [*prefix, 1, 2], None)
    plan = scheduler.schedule()
    assert plan is not None and plan.new_seqs[0].block_ids == (0, 1, 2, 3)
    scheduler.update(0, {1: 3})
    scheduler.add_request(2, [*prefix, 5, 6, 7], None)
    plan = scheduler.schedule()
    assert plan is not None
    (new,) = plan.new_seqs
    assert (new.seq_id, new.num_computed_tokens, new.num_new_tokens) == (2, 12, 3)
    assert new.block_ids == (0, 1, 2, 4)  # the three prefix blocks, then a fresh one
    assert plan.num_scheduled_tokens == 1 + 3  # 1's decode, 2's three new tokens
    assert scheduler.kv_cache.usage().prefix_hit_tokens == 12


def test_max_model_len_finishes_a_sequence_with_reason_length() -> None:
    scheduler, _ = make_scheduler(max_model_len=6)
    scheduler.add_request(1, [1, 2, 3, 4], None)
    for token in (10, 11):
        plan = scheduler.schedule()
        assert plan is not None
        update = scheduler.update(plan.step_id, {1: token})
    assert update.length_capped_seq_ids == (1,) and dict(update.new_tokens) == {1: 11}
    assert scheduler.get_state(1) is None
    plan = scheduler.schedule()
    assert plan is not None and plan.finished_seq_ids == (1,)


def test_schedule_returns_none_when_idle() -> None:
    scheduler, _ = make_scheduler()
    assert scheduler.schedule() is None
    assert scheduler.stats().num_steps == 0


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=8)
    with pytest.raises(ValueError, match="max_inflight_steps"):
        SchedulerConfig(max_inflight_steps=0)
    with pytest.raises(ValueError, match="needs 5 blocks"):
        Scheduler(SchedulerConfig(max_model_len=20), KVCacheConfig(num_blocks=4, block_size=4))
    assert SchedulerConfig(max_inflight_steps=3, run_ahead=True).max_outstanding_steps == 6
