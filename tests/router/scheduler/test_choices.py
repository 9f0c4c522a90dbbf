"""n > 1: the prompt is computed once, then each choice forks off it (copy-on-write)."""

from __future__ import annotations

from kvcache import BlockCopy
from router.scheduler import CachedSeq, ChoiceSpec, NewSeq, SeqState
from tests.router.scheduler.driver import EOS, VOCAB, Driver, make_scheduler
from tests.router.scheduler.fake_pipeline import reference_tokens


def test_choices_share_the_prompt_blocks_and_copy_the_partial_one() -> None:
    scheduler, pipeline = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(20, 30))  # 10 tokens: the shared part is 9 (blocks 0, 1 and 2/4)
    scheduler.add_request(1, prompt, 1, extra_choices=[ChoiceSpec(2, 2), ChoiceSpec(3, 3)])
    assert scheduler.get_state(2) is SeqState.CHOICE_PENDING
    driver = Driver(scheduler, pipeline, max_tokens=dict.fromkeys((1, 2, 3), 8))
    first = driver.plan()
    assert first is not None
    assert first.new_seqs == (NewSeq(1, tuple(prompt), 10, 1, (0, 1, 2), 0, 9, False),)
    driver.complete()
    second = driver.plan()
    assert second is not None
    assert second.block_copies == (BlockCopy(2, 3), BlockCopy(2, 4))
    assert second.cached_seqs == (CachedSeq(1, (), 9, 1, (), None, True),)  # 29 was sent
    assert second.new_seqs == (NewSeq(2, tuple(prompt), 10, 2, (0, 1, 3), 9, 1, True),
                               NewSeq(3, tuple(prompt), 10, 3, (0, 1, 4), 9, 1, True))
    assert scheduler.kv_cache.block_ref_counts(1) == (3, 3, 1)
    driver.run()
    for seq_id in (1, 2, 3):
        assert driver.outputs[seq_id] == reference_tokens(prompt, seq_id, VOCAB, 8, EOS)
    assert len({tuple(driver.outputs[i]) for i in (1, 2, 3)}) == 3  # seeds differ
    assert scheduler.kv_cache.usage().num_used_blocks == 0


def test_choices_fork_at_admission_when_the_cache_holds_the_shared_prompt() -> None:
    scheduler, pipeline = make_scheduler(num_blocks=16, block_size=4)
    driver = Driver(scheduler, pipeline, max_tokens=dict.fromkeys((1, 2, 3), 3))
    base = list(range(40, 48))
    scheduler.add_request(1, [*base, 0], 1)
    driver.run()
    scheduler.add_request(2, [*base, 5], 2, extra_choices=[ChoiceSpec(3, 3)])
    plan = driver.plan()
    assert plan is not None and plan.block_copies == ()
    (parent,) = plan.new_seqs
    assert (parent.seq_id, parent.num_computed_tokens, parent.num_new_tokens) == (2, 8, 1)
    assert scheduler.get_state(3) is SeqState.RUNNING  # forked already: the hit is shared
    assert scheduler.kv_cache.block_ids(3) == parent.block_ids[:2]
    driver.run()
    for seq_id in (2, 3):
        assert driver.outputs[seq_id] == reference_tokens([*base, 5], seq_id, VOCAB, 3, EOS)


def test_aborting_the_parent_before_the_fork_ends_its_pending_choices() -> None:
    scheduler, pipeline = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(1, list(range(20)), 1, extra_choices=[ChoiceSpec(2, 2)])
    driver = Driver(scheduler, pipeline)
    driver.plan()
    assert scheduler.abort(1)
    assert scheduler.get_state(2) is None and not scheduler.abort(2)
    driver.run()
    assert scheduler.kv_cache.usage().num_used_blocks == 0
    assert [i for p in driver.plans for i in p.aborted_seq_ids] == [1]
    scheduler.check_integrity()


def test_a_fork_and_a_chunk_waiting_on_each_others_blocks_do_not_stall() -> None:
    # 4 blocks of 2: the parent's shared prompt (3 tokens) and the other request's first chunk
    # take all of them; the fork needs a block for its copy, the chunk needs room to go on.
    scheduler, pipeline = make_scheduler(num_blocks=4, block_size=2, max_model_len=8,
                                         max_num_batched_tokens=6, max_num_seqs=4)
    driver = Driver(scheduler, pipeline, max_tokens={1: 2, 2: 2, 3: 1}, use_eos=False)
    scheduler.add_request(1, [1, 2, 3, 4], 1, extra_choices=[ChoiceSpec(2, 2)])
    scheduler.add_request(3, [5, 6, 7, 8, 9, 10, 11], 3)
    first = driver.plan()
    assert first is not None
    assert [(s.seq_id, s.num_new_tokens) for s in first.new_seqs] == [(1, 3), (3, 3)]
    driver.complete()
    second = driver.plan()  # the fork finds no block; 3's chunk fills its last slot
    assert second is not None and second.block_copies == ()
    assert [(s.seq_id, s.num_new_tokens) for s in second.cached_seqs] == [(3, 1)]
    driver.complete()
    assert scheduler.kv_cache.num_available_blocks == 0
    stalled = driver.plan()  # nothing fits and nothing is outstanding: the newest gives way
    assert stalled is not None and stalled.seq_ids == () and stalled.preempted_seq_ids == (3,)
    driver.run()
    for seq_id, prompt in ((1, [1, 2, 3, 4]), (2, [1, 2, 3, 4]), (3, [5, 6, 7, 8, 9, 10, 11])):
        expected = reference_tokens(prompt, seq_id, VOCAB, driver.max_tokens[seq_id], None)
        assert driver.outputs[seq_id] == expected
    assert scheduler.kv_cache.usage().num_used_blocks == 0
    scheduler.check_integrity()
