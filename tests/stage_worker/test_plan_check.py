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
    chunks, ids = held.apply(_plan(_new(1, tokens=tokens)))
    assert ids == [] and [c.num_new for c in chunks] == [6]
    decode = StageCachedSeq(1, (2,), 6, 1, (77,), True)
    chunks, ids = held.apply(StagePlan(2, (), (decode,), ()))
    seq = held.seqs[1]
    assert ids == [] and seq.token_ids == [] and seq.output_ids == []
    assert seq.sampling is None and seq.block_table == [0, 1, 2]
    assert chunks[0].block_table == (0, 1, 2)


def test_first_and_last_stages_keep_prompt_and_outputs() -> None:
    held = HeldSeqs(keep_tokens=True)
    _, ids = held.apply(_plan(_new(1, tokens=(*PROMPT, 11), num_new=7)))
    assert ids == [*PROMPT, 11]
    _, ids = held.apply(StagePlan(2, (), (StageCachedSeq(1, (), 7, 1, (12,), True),), ()))
    assert ids == [12]
    seq = held.seqs[1]
    assert seq.prompt_ids == list(PROMPT) and seq.output_ids == [11] and seq.num_outputs == 1


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
