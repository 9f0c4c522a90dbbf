"""Held sequences (a middle stage keeps no tokens) and the plan check (limits named)."""

from __future__ import annotations

import pytest

from foundation.sampling_params import SamplingParams
from stage_worker.held_seqs import HeldSeqs
from stage_worker.plan import PlanError, StageCachedSeq, StageNewSeq, StagePlan
from stage_worker.plan_check import StepLimits, check_plan

LIMITS = StepLimits(max_num_batched_tokens=64, max_num_seqs=4, num_blocks=32, block_size=4)
PROMPT = (5, 6, 7, 8, 9, 10)


def _new(seq_id: int, blocks: tuple[int, ...] = (0, 1), num_new: int = 6,
         tokens: tuple[int, ...] = PROMPT) -> StageNewSeq:
    return StageNewSeq(seq_id, tokens, len(PROMPT), blocks, 0, num_new, True,
                       SamplingParams(temperature=0.0))


def _plan(*new: StageNewSeq, cached: tuple[StageCachedSeq, ...] = (),
          copies: tuple[tuple[int, int], ...] = ()) -> StagePlan:
    return StagePlan(1, new, cached, (), copies)


@pytest.mark.parametrize("tokens", [PROMPT, ()], ids=["with-tokens", "without-tokens"])
def test_a_middle_stage_holds_no_token_ids(tokens: tuple[int, ...]) -> None:
    held = HeldSeqs(keep_tokens=False)
    step = held.apply(_plan(_new(1, tokens=tokens)))
    assert step.input_ids == [] and [c.num_new for c in step.chunks] == [6]
    decode = StageCachedSeq(1, (2,), 6, 1, (77,), True)
    step = held.apply(StagePlan(2, (), (decode,), ()))
    seq = held.seqs[1]
    assert step.input_ids == [] and seq.token_ids == [] and seq.output_ids == []
    assert seq.sampling is None and seq.block_table == [0, 1, 2]
    assert list(step.chunks[0].block_table) == [0, 1, 2]
    ahead = StageCachedSeq(1, (), 7, 1, (), True, 2)  # run-ahead: nothing to keep either
    assert held.apply(StagePlan(3, (), (ahead,), ())).ahead == [] and seq.token_ids == []


def test_first_and_last_stages_keep_prompt_and_outputs() -> None:
    held = HeldSeqs(keep_tokens=True)
    assert held.apply(_plan(_new(1, tokens=(*PROMPT, 11), num_new=7))).input_ids == [*PROMPT, 11]
    step = held.apply(StagePlan(2, (), (StageCachedSeq(1, (), 7, 1, (12,), True),), ()))
    assert step.input_ids == [12] and step.ahead == []
    seq = held.seqs[1]
    assert seq.prompt_ids == list(PROMPT) and seq.output_ids == [11] and seq.num_outputs == 1


def test_a_run_ahead_input_joins_the_history_like_an_appended_token() -> None:
    held = HeldSeqs(keep_tokens=True)
    held.apply(_plan(_new(1, num_new=6), _new(2, blocks=(2, 3))))
    held.record_sampled(1, [1, 2], [40, 41])
    plan = StagePlan(4, (), (StageCachedSeq(2, (), 6, 1, (41,), True),
                             StageCachedSeq(1, (4,), 6, 1, (), True, 1)), ())
    step = held.apply(plan, fed={1: 40})
    assert step.input_ids == [41, 40] and step.ahead == [(1, 1, 1)]
    assert held.seqs[1].token_ids == [*PROMPT, 40] and held.seqs[2].token_ids == [*PROMPT, 41]
    assert held.seqs[1].last_sample_step == 1 and held.seqs[1].output_ids == [40]


def test_limits_are_named() -> None:
    held = HeldSeqs().seqs
    too_many_tokens = _plan(*(_new(i, (2 * i, 2 * i + 1), 6) for i in range(3)),
                            _new(9, tuple(range(20, 32)), 47))
    with pytest.raises(PlanError, match=r"65 tokens.*max_num_batched_tokens \(64\)"):
        check_plan(too_many_tokens, held, LIMITS, needs_tokens=False)
    too_many_seqs = _plan(*(_new(i, (i,), 1) for i in range(5)))
    with pytest.raises(PlanError, match=r"5 sequences.*max_num_seqs \(4\)"):
        check_plan(too_many_seqs, held, LIMITS, needs_tokens=False)
    with pytest.raises(PlanError, match=r"sequence 3: block id 32 .*\[0, 32\)"):
        check_plan(_plan(_new(3, (0, 32))), held, LIMITS, needs_tokens=False)
    with pytest.raises(PlanError, match=r"block copies: block id -1"):
        check_plan(_plan(copies=((-1, 2),)), held, LIMITS, needs_tokens=False)
    with pytest.raises(PlanError, match=r"1 blocks cannot hold 6 tokens \(block size 4\)"):
        check_plan(_plan(_new(3, (0,))), held, LIMITS, needs_tokens=False)


def test_state_contradictions_are_refused_before_anything_changes() -> None:
    held = HeldSeqs()
    held.apply(_plan(_new(1)))
    seqs = held.seqs
    with pytest.raises(PlanError, match="sequence 1 is sent as new but already held"):
        check_plan(_plan(_new(1)), seqs, LIMITS, needs_tokens=True)
    with pytest.raises(PlanError, match="sequence 2 is not held"):
        check_plan(_plan(cached=(StageCachedSeq(2, (), 0, 1, (), True),)), seqs, LIMITS, True)
    with pytest.raises(PlanError, match="listed twice"):
        check_plan(_plan(_new(4), _new(4)), seqs, LIMITS, needs_tokens=True)
    with pytest.raises(PlanError, match="knows 6 tokens"):
        check_plan(_plan(cached=(StageCachedSeq(1, (), 6, 1, (), True),)), seqs, LIMITS, True)
    decode = StageCachedSeq(1, (), 6, 1, (), True)  # fine where tokens are not read
    check_plan(_plan(cached=(decode,)), seqs, LIMITS, needs_tokens=False)
    freed_then_new = StagePlan(2, (_new(1),), (), (1,))
    check_plan(freed_then_new, seqs, LIMITS, needs_tokens=True)
    assert list(seqs) == [1] and seqs[1].block_table == [0, 1]


def test_run_ahead_inputs_are_checked() -> None:
    held = HeldSeqs()
    held.apply(_plan(_new(1)))
    held.record_sampled(0, [1], [50])
    seqs = held.seqs

    def check(cached: StageCachedSeq, knows_samples: bool = False) -> None:
        check_plan(StagePlan(3, (), (cached,), ()), seqs, LIMITS, True, knows_samples)

    check(StageCachedSeq(1, (), 6, 1, (), True, 0), knows_samples=True)  # first stage's view
    with pytest.raises(PlanError, match="sequence 1 takes its input from step 0 but computes "
                                        "2 tokens and appends 0"):
        check(StageCachedSeq(1, (), 6, 2, (), True, 0))
    with pytest.raises(PlanError, match="computes 1 tokens and appends 1"):
        check(StageCachedSeq(1, (), 6, 1, (9,), True, 0))
    with pytest.raises(PlanError, match="step 3, sequence 1 takes its input from step 3, not "
                                        "an earlier step"):
        check(StageCachedSeq(1, (), 6, 1, (), True, 3))
    with pytest.raises(PlanError, match="from step 2, but this stage last sampled it at step 0"):
        check(StageCachedSeq(1, (), 6, 1, (), True, 2), knows_samples=True)
    check(StageCachedSeq(1, (), 6, 1, (), True, 2))  # a first stage takes it from the link


def test_a_refused_diff_is_named_as_the_first_one_in_batch_order() -> None:
    held = HeldSeqs()
    held.apply(_plan(_new(1), _new(2, blocks=(2, 3))))
    seqs = held.seqs
    decode = StageCachedSeq(1, (), 6, 1, (7,), True)
    short = StageCachedSeq(2, (), 8, 1, (7,), True)  # 2 blocks of 4 cannot hold 9 tokens
    with pytest.raises(PlanError, match="step 1, sequence 1 is listed twice"):
        check_plan(_plan(cached=(decode, decode)), seqs, LIMITS, True)
    with pytest.raises(PlanError, match="step 1, sequence 2: 2 blocks cannot hold 9 tokens"):
        check_plan(_plan(cached=(short, decode, decode)), seqs, LIMITS, True)
    with pytest.raises(PlanError, match="step 1, sequence 1 is listed twice"):
        check_plan(StagePlan(1, (_new(1),), (decode,), (1,)), seqs, LIMITS, True)
    with pytest.raises(PlanError, match="step 1, sequence 1 is not held"):
        check_plan(StagePlan(1, (), (decode,), (1,)), seqs, LIMITS, True)
    check_plan(_plan(cached=(decode, StageCachedSeq(2, (4,), 6, 1, (7,), True))), seqs,
               LIMITS, True)


def test_a_last_stage_keeps_tokens_but_builds_no_inputs() -> None:
    held = HeldSeqs(keep_tokens=True, builds_inputs=False)
    step = held.apply(_plan(_new(1)))
    assert step.input_ids == [] and [c.num_new for c in step.chunks] == [6]
    held.record_sampled(1, [1], [40])
    ahead = StageCachedSeq(1, (2,), 6, 1, (), True, 1)
    step = held.apply(StagePlan(2, (), (ahead,), ()), fed={1: 40})
    assert step.input_ids == [] and step.ahead == []
    assert held.seqs[1].token_ids == [*PROMPT, 40] and held.seqs[1].block_table == [0, 1, 2]
    assert step.chunks[0] == (1, 6, 1, [0, 1, 2], True, 0)


def test_sampled_tokens_skip_a_freed_sequence_and_fill_a_waiting_placeholder() -> None:
    """`record_sampled` of a step one of whose sequences was freed since leaves the others
    as a step without it does; a placeholder waiting for the step gets its token; a step
    whose ids and tokens differ in number is refused."""
    def held_with(*seq_ids: int) -> HeldSeqs:
        held = HeldSeqs(keep_tokens=True)
        held.apply(_plan(*(_new(s, blocks=(2 * s, 2 * s + 1)) for s in seq_ids)))
        return held

    def state(held: HeldSeqs) -> dict[int, tuple[object, ...]]:
        return {s: (h.output_ids, h.num_outputs, h.last_sample_step, h.token_ids)
                for s, h in held.seqs.items()}

    held, with_freed = held_with(1, 2, 3), held_with(1, 2, 3, 9)
    with_freed.free(9)  # a sequence freed since the step: its token is skipped
    held.record_sampled(4, [1, 2, 3], [40, 41, 42])
    with_freed.record_sampled(4, [1, 9, 2, 3], [40, 99, 41, 42])
    assert state(held) == state(with_freed)
    assert state(held)[2] == ([41], 1, 4, list(PROMPT))

    waiting = held_with(1, 2)  # a run-ahead placeholder of sequence 1 (one-stage pipeline)
    waiting.apply(StagePlan(5, (), (StageCachedSeq(1, (), 6, 1, (), True, 4),), ()),
                  deferred=True)
    waiting.record_sampled(4, [1, 2], [40, 41])
    assert waiting.seqs[1].token_ids == [*PROMPT, 40] and waiting.seqs[2].output_ids == [41]
    with pytest.raises(ValueError):
        held.record_sampled(6, [1, 2], [50])
