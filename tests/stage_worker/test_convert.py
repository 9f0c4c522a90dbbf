"""A plan's cached sequences on the wire: the router packs them into one CachedBatch per stage,
the stage unpacks the same StageCachedSeq tuples; a batch whose columns disagree is a
PlanError naming the column and the lengths."""

from __future__ import annotations

from array import array

import pytest

from kvcache import BlockCopy
from protos.stagemesh.stage.v1 import stage_pb2 as pb
from router.pipeline.convert import cached_batch_to_proto, plans_to_protos
from router.scheduler import CachedSeq, NewSeq, StepPlan
from stage_worker.convert import plan_from_proto
from stage_worker.plan import PlanError, StageCachedSeq, StageNewSeq, StagePlan

BIG = 2**63 - 1

DECODES = tuple(CachedSeq(10 + i, (20 + i,) if i % 3 == 0 else (), 40 + i, 1, (100 + i,),
                          None, True) for i in range(7))
PREFILL_CHUNKS = (CachedSeq(1, tuple(range(64)), 0, 512, (), None, False),
                  CachedSeq(2, (7, 3), 2048, 32, (), None, True))  # the final chunk samples
RUN_AHEAD = (CachedSeq(1, (), 9, 1, (), 0, True), CachedSeq(2, (5,), 30, 1, (), 2**40, True),
             CachedSeq(3, (), 12, 1, (), 7, True))
# The steady decode step: every sequence a run-ahead decode (both ends convert it on a path
# of their own), one of them opening a block.
STEADY = tuple(CachedSeq(30 + i, (70,) if i == 2 else (), 60 + i, 1, (), 9 + i % 2, True)
               for i in range(5))
MIXED = (CachedSeq(5, (), 3, 1, (), 6, True),  # run-ahead
         CachedSeq(1 << 41, (8, 9, 10), 64, 24, (), None, False),  # a prefill chunk
         CachedSeq(6, (), 4, 3, (-1, BIG, 0), None, True),  # tokens appended meanwhile
         CachedSeq(BIG, (2**31 - 1,), 2**31 - 1, 0, (4,), None, True),  # int32/int64 limits
         CachedSeq(7, (11,), 16, 1, (), 2**62, False))


def _stage_view(seq: CachedSeq, with_tokens: bool) -> StageCachedSeq:
    """What a stage that reads tokens (or, not `with_tokens`, a middle stage) should get."""
    return StageCachedSeq(seq.seq_id, seq.new_block_ids, seq.num_computed_tokens,
                          seq.num_new_tokens, seq.new_token_ids if with_tokens else (),
                          seq.sample, seq.input_from_step if with_tokens else None)


def _received(plan: StepPlan, num_stages: int) -> list[StagePlan]:
    """Every stage's plan as it converts it after the wire."""
    return [plan_from_proto(pb.StepPlans.FromString(msg.SerializeToString()).plans[0])
            for msg in plans_to_protos([plan], num_stages)]


@pytest.mark.parametrize("cached", [DECODES, PREFILL_CHUNKS, RUN_AHEAD, STEADY, MIXED, ()],
                         ids=["decodes", "prefill-chunks", "run-ahead", "steady", "mixed",
                              "empty"])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_every_stage_gets_the_cached_seqs_it_reads(cached: tuple[CachedSeq, ...],
                                                   num_stages: int) -> None:
    plan = StepPlan(step_id=11, new_seqs=(), cached_seqs=cached, finished_seq_ids=(4,))
    received = _received(plan, num_stages)
    for index, got in enumerate(received):
        reads_tokens = index in (0, num_stages - 1)
        assert got == StagePlan(11, (), tuple(_stage_view(s, reads_tokens) for s in cached),
                                (4,))
        for seq in got.cached_seqs:  # the types downstream relies on, not just equal values
            assert type(seq) is StageCachedSeq and type(seq.sample) is bool
            assert type(seq.new_block_ids) is tuple and type(seq.append_token_ids) is tuple
            assert seq.input_from_step is None or type(seq.input_from_step) is int


def test_exact_stage_plans_first_middle_last() -> None:
    new = NewSeq(seq_id=9, token_ids=(1, 2), prompt_len=2, sampling=None, block_ids=(0,),
                 num_computed_tokens=0, num_new_tokens=2, sample=True)
    plan = StepPlan(step_id=3, new_seqs=(new,), cached_seqs=(
        CachedSeq(2, (4,), 16, 1, (9,), None, True),
        CachedSeq(4, (), 20, 1, (), 1, True),
        CachedSeq(6, (5, 6), 0, 16, (), None, False)))
    first, middle, last = _received(plan, 3)
    assert first == last == StagePlan(3, (StageNewSeq(9, (1, 2), 2, (0,), 0, 2, True, None),), (
        StageCachedSeq(2, (4,), 16, 1, (9,), True, None),
        StageCachedSeq(4, (), 20, 1, (), True, 1),
        StageCachedSeq(6, (5, 6), 0, 16, (), False, None)), ())
    assert middle == StagePlan(3, (StageNewSeq(9, (), 2, (0,), 0, 2, True, None),), (
        StageCachedSeq(2, (4,), 16, 1, (), True, None),
        StageCachedSeq(4, (), 20, 1, (), True, None),
        StageCachedSeq(6, (5, 6), 0, 16, (), False, None)), ())


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_frees_copies_and_a_trace_reach_every_stage(num_stages: int) -> None:
    """The fields most plans leave empty, set in one plan beside a steady batch."""
    plan = StepPlan(step_id=8, new_seqs=(), cached_seqs=STEADY, finished_seq_ids=(3,),
                    aborted_seq_ids=(4,), preempted_seq_ids=(5,),
                    block_copies=(BlockCopy(6, 7), BlockCopy(8, 9)))
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for index, msg in enumerate(plans_to_protos([plan], num_stages, {8: trace})):
        got = plan_from_proto(pb.StepPlans.FromString(msg.SerializeToString()).plans[0])
        reads_tokens = index in (0, num_stages - 1)
        assert got == StagePlan(8, (), tuple(_stage_view(s, reads_tokens) for s in STEADY),
                                (3, 4, 5), ((6, 7), (8, 9)), trace)


def test_an_unset_batch_is_no_cached_seqs() -> None:
    assert plan_from_proto(pb.StepPlan(step_id=2, free_seq_ids=[1])) == StagePlan(2, (), (), (1,))


def _packed(typecode: str, values: list[int]) -> bytes:
    return array(typecode, values).tobytes()  # the test machines are little-endian


def _good() -> pb.CachedBatch:
    """Two sequences: a run-ahead decode that opens a block, a decode with its input token."""
    return pb.CachedBatch(
        seq_ids=_packed("q", [1, 2]), num_computed=_packed("i", [8, 3]),
        num_new=_packed("i", [1, 1]), flags=bytes([3, 1]), input_from_step=_packed("q", [5]),
        new_block_counts=_packed("i", [1, 0]), new_block_ids=_packed("i", [7]),
        append_token_counts=_packed("i", [0, 1]), append_token_ids=_packed("q", [42]))


def test_the_hand_packed_batch_decodes() -> None:
    plan = plan_from_proto(pb.StepPlan(step_id=1, cached_batch=_good()))
    assert plan.cached_seqs == (StageCachedSeq(1, (7,), 8, 1, (), True, 5),
                                StageCachedSeq(2, (), 3, 1, (42,), True, None))


@pytest.mark.parametrize(("field", "value", "error"), [
    ("seq_ids", b"\0" * 12, "seq_ids holds 12 bytes, not whole int64s (8 bytes each)"),
    ("num_computed", b"\0" * 9, "num_computed holds 9 bytes, not whole int32s (4 bytes each)"),
    ("num_new", _packed("i", [1]), "num_new holds 1 int32s for 2 sequences (seq_ids)"),
    ("num_computed", _packed("i", [1, 2, 3]),
     "num_computed holds 3 int32s for 2 sequences (seq_ids)"),
    ("flags", bytes([1]), "flags holds 1 uint8s for 2 sequences (seq_ids)"),
    ("flags", bytes([3, 5]), "flags holds 0x5; only bits 0x1 (sample) and 0x2 (run-ahead)"),
    ("flags", bytes([1, 1]), "flags marks 0 sequences run-ahead, but input_from_step holds 1"),
    ("input_from_step", _packed("q", [5, 6]),
     "flags marks 1 sequences run-ahead, but input_from_step holds 2 steps"),
    ("input_from_step", b"\0" * 4, "input_from_step holds 4 bytes, not whole int64s"),
    ("new_block_counts", _packed("i", [1]),
     "new_block_counts holds 1 int32s for 2 sequences (seq_ids)"),
    ("new_block_counts", _packed("i", [1, 1]),
     "new_block_counts sum to 2, but new_block_ids holds 1"),
    ("new_block_ids", b"", "new_block_counts sum to 1, but new_block_ids holds 0"),
    ("new_block_counts", _packed("i", [-1, 2]), "new_block_counts holds a negative count"),
    ("new_block_ids", b"\0" * 6, "new_block_ids holds 6 bytes, not whole int32s"),
    ("append_token_counts", b"", "append_token_counts holds 0 int32s for 2 sequences"),
    ("append_token_ids", _packed("q", [42, 43]),
     "append_token_counts sum to 1, but append_token_ids holds 2"),
    ("append_token_ids", b"\0" * 7, "append_token_ids holds 7 bytes, not whole int64s"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else None)
def test_a_malformed_batch_is_a_plan_error_naming_field_and_lengths(field: str, value: bytes,
                                                                     error: str) -> None:
    batch = _good()
    setattr(batch, field, value)
    with pytest.raises(PlanError) as raised:
        plan_from_proto(pb.StepPlan(step_id=6, cached_batch=batch))
    assert str(raised.value).startswith(f"step 6: cached_batch.{error}"), str(raised.value)


@pytest.mark.parametrize(("field", "value", "error"), [
    ("input_from_step", _packed("q", [5]), "input_from_step holds 1 int64s for 2 sequences"),
    ("num_new", _packed("i", [1, 1, 1]), "num_new holds 3 int32s for 2 sequences"),
    ("new_block_counts", _packed("i", [0, 1]),
     "new_block_counts sum to 1, but new_block_ids holds 0"),
])
def test_a_malformed_steady_decode_batch_is_a_plan_error(field: str, value: bytes,
                                                         error: str) -> None:
    """Two run-ahead decodes, nothing appended: the columns are checked on that path too."""
    batch = pb.CachedBatch(
        seq_ids=_packed("q", [1, 2]), num_computed=_packed("i", [8, 3]),
        num_new=_packed("i", [1, 1]), flags=bytes([3, 3]), input_from_step=_packed("q", [5, 5]),
        new_block_counts=_packed("i", [0, 0]), append_token_counts=_packed("i", [0, 0]))
    assert plan_from_proto(pb.StepPlan(step_id=6, cached_batch=batch)).cached_seqs == (
        StageCachedSeq(1, (), 8, 1, (), True, 5), StageCachedSeq(2, (), 3, 1, (), True, 5))
    setattr(batch, field, value)
    with pytest.raises(PlanError) as raised:
        plan_from_proto(pb.StepPlan(step_id=6, cached_batch=batch))
    assert str(raised.value).startswith(f"step 6: cached_batch.{error}"), str(raised.value)


def test_a_router_batch_beyond_int32_is_refused_before_it_is_sent() -> None:
    with pytest.raises(OverflowError):
        cached_batch_to_proto([CachedSeq(1, (2**31,), 0, 1, (), None, True)], True)
