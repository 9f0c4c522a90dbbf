"""Protos <-> the stage's domain objects. The only stage module that imports `*_pb2`."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from foundation.sampling_params import SamplingParams
from protos.stagemesh.stage.v1 import stage_pb2 as pb
from stage_worker.plan import StageCachedSeq, StageNewSeq, StageOutcome, StagePlan

_new_tuple = tuple.__new__  # builds a StageCachedSeq without the NamedTuple's Python __new__


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty, presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def plan_from_proto(msg: pb.StepPlan) -> StagePlan:
    new = tuple(
        StageNewSeq(s.seq_id, tuple(s.token_ids), s.prompt_len, tuple(s.block_ids), s.num_computed,
                    s.num_new, s.sample,
                    sampling_from_proto(s.sampling) if s.HasField("sampling") else None)
        for s in msg.new_seqs
    )
    return StagePlan(msg.step_id, new, tuple(map(_cached_from_proto, msg.cached_seqs)),
                     tuple(msg.free_seq_ids), tuple((c.src, c.dst) for c in msg.block_copies))


def _cached_from_proto(s: pb.CachedSequence) -> StageCachedSeq:
    """The hot path of the conversion (every running sequence, every step)."""
    blocks, tokens = s.new_block_ids, s.append_token_ids
    return _new_tuple(StageCachedSeq, (
        s.seq_id, tuple(blocks) if blocks else (), s.num_computed, s.num_new,
        tuple(tokens) if len(tokens) != 1 else (tokens[0],), s.sample,
        s.input_from_step if s.HasField("input_from_step") else None))


def outcome_to_proto(outcome: StageOutcome) -> pb.StepResult:
    """The sampled tokens as packed little-endian int64 arrays; a SampledToken message only
    for the sequences that asked for log probabilities."""
    logprobs = [
        pb.SampledToken(seq_id=t.seq_id, token_id=t.token_id, logprob=t.logprob,
                        top_token_ids=t.top_token_ids, top_logprobs=t.top_logprobs)
        for t in outcome.logprobs
    ]
    return pb.StepResult(step_id=outcome.step_id, tokens=logprobs,
                         kv_blocks_used=outcome.kv_blocks_used,
                         num_sequences=outcome.num_sequences,
                         sampled_seq_ids=pack_int64(outcome.seq_ids),
                         sampled_token_ids=pack_int64(outcome.token_ids))


def pack_int64(values: Sequence[int]) -> bytes:
    """`values` as little-endian int64, 8 bytes each."""
    packed = array("q", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def error_to_proto(step_id: int, message: str) -> pb.StepResult:
    return pb.StepResult(step_id=step_id, error=message)
