"""A full block enters the prefix cache under one condition, however its last position came.

The condition: its tokens are known and its positions are in a plan already sent. A block
completed by a decode, by a prefill chunk or by a first prefill is registered at the end of the
``schedule()`` that plans its last position; one completed by a run-ahead decode (whose input
token is not known yet) when that token comes back through ``update()``. Either way a later
request with the same prefix hits exactly that block.
"""

from __future__ import annotations

from kvcache import KVCacheConfig
from router.scheduler import Scheduler, SchedulerConfig, StepPlan
from tests.router.scheduler.driver import make_scheduler

B = 4


def _hashed(scheduler: Scheduler) -> int:
    return scheduler.kv_cache.usage().num_hashed_blocks


def _plan(scheduler: Scheduler) -> StepPlan:
    plan = scheduler.schedule()
    assert plan is not None
    return plan


def _later_request_hits(scheduler: Scheduler, prefix: list[int], block_ids: tuple[int, ...]
                        ) -> None:
    """A new request sharing ``prefix`` starts with exactly ``block_ids`` computed."""
    scheduler.add_request(99, [*prefix, 49], None)
    plan = _plan(scheduler)
    (new,) = [s for s in plan.new_seqs if s.seq_id == 99]
    assert new.num_computed_tokens == len(prefix)
    assert new.block_ids[: len(block_ids)] == block_ids


def test_a_block_completed_by_a_decode_is_registered_when_the_decode_is_planned() -> None:
    scheduler, _ = make_scheduler(block_size=B)
    scheduler.add_request(1, [10, 11, 12], None)
    prefill = _plan(scheduler)
    assert _hashed(scheduler) == 0  # positions 0-2: block 0 not full
    scheduler.update(prefill.step_id, {1: 13})
    decode = _plan(scheduler)  # position 3, input 13: block 0 is full and known
    assert decode.cached_seqs[0].new_token_ids == (13,)
    assert _hashed(scheduler) == 1
    scheduler.update(decode.step_id, {1: 14})
    _later_request_hits(scheduler, [10, 11, 12, 13], prefill.new_seqs[0].block_ids[:1])
    scheduler.check_integrity()


def test_a_block_completed_by_a_prefill_chunk_is_registered_when_the_chunk_is_planned() -> None:
    scheduler, _ = make_scheduler(block_size=B, max_num_batched_tokens=6, max_num_seqs=4)
    prompt = list(range(20, 30))
    scheduler.add_request(1, prompt, None)
    first = _plan(scheduler)  # chunk [0, 6): block 0 full (the first prefill completes it)
    assert _hashed(scheduler) == 1
    scheduler.update(first.step_id, {})
    second = _plan(scheduler)  # chunk [6, 10), a CachedSeq: completes block 1
    assert second.cached_seqs[0].num_computed_tokens == 6
    assert _hashed(scheduler) == 2
    scheduler.update(second.step_id, {1: 30})
    _later_request_hits(scheduler, prompt[:8], first.new_seqs[0].block_ids[:2])
    scheduler.check_integrity()


def test_a_block_completed_by_a_run_ahead_decode_is_registered_when_its_token_arrives() -> None:
    scheduler, _ = make_scheduler(block_size=B, run_ahead=True)
    scheduler.add_request(1, [10, 11, 12], None)
    prefill = _plan(scheduler)
    ahead = _plan(scheduler)  # position 3, its input sampled at step 0: not known yet
    assert ahead.cached_seqs[0].input_from_step == prefill.step_id
    assert _hashed(scheduler) == 0
    scheduler.update(prefill.step_id, {1: 13})  # now known, and already scheduled
    assert _hashed(scheduler) == 1
    scheduler.update(ahead.step_id, {1: 14})
    _later_request_hits(scheduler, [10, 11, 12, 13], prefill.new_seqs[0].block_ids[:1])
    scheduler.check_integrity()


def test_nothing_is_registered_with_prefix_caching_off() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2,
                                          max_model_len=32),
                          KVCacheConfig(num_blocks=16, block_size=B, enable_prefix_caching=False))
    scheduler.add_request(1, list(range(9)), None)
    for token in (50, 51, 52):
        plan = _plan(scheduler)
        scheduler.update(plan.step_id, dict.fromkeys(plan.sampling_seq_ids, token))
    assert _hashed(scheduler) == 0
    scheduler.check_integrity()
