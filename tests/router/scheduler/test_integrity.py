"""The scheduler keeps counts, the KV manager owns the blocks: the integrity check compares
every count with the manager's answer for that sequence, and catches any drift."""

from __future__ import annotations

import pytest

from kvcache import IntegrityError
from router.scheduler import Scheduler
from router.scheduler.sequence import Sequence
from tests.router.scheduler.driver import make_scheduler


def _running(scheduler: Scheduler) -> tuple[Scheduler, Sequence]:
    scheduler.add_request(1, list(range(10)), None)
    plan = scheduler.schedule()
    assert plan is not None
    scheduler.update(plan.step_id, {1: 5})
    scheduler.check_integrity()
    return scheduler, scheduler._state.seqs[1]


def test_the_counts_of_a_running_sequence_match_the_managers_answers() -> None:
    scheduler, seq = _running(make_scheduler(block_size=4)[0])
    kv = scheduler.kv_cache
    assert seq.num_slots == kv.num_slots(1) == 12
    assert seq.num_block_ids_sent == len(kv.block_ids(1)) == 3
    assert seq.next_cache_at == kv.cache_threshold(1) == 12  # blocks 0 and 1 registered
    assert kv.num_seqs == scheduler.num_running == 1


@pytest.mark.parametrize("field", ["num_slots", "num_block_ids_sent", "next_cache_at"])
def test_a_count_that_drifts_from_the_manager_is_caught(field: str) -> None:
    scheduler, seq = _running(make_scheduler(block_size=4)[0])
    setattr(seq, field, getattr(seq, field) + 4)
    with pytest.raises(IntegrityError):
        scheduler.check_integrity()


def test_blocks_held_by_a_sequence_that_does_not_run_are_caught() -> None:
    scheduler, _ = _running(make_scheduler(block_size=4)[0])
    scheduler._state.kv.allocate(77, 4)  # blocks the scheduler knows nothing of
    with pytest.raises(IntegrityError, match="hold blocks"):
        scheduler.check_integrity()
