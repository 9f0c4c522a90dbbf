"""Protos <-> the stage's domain objects. The only stage module that imports `*_pb2`."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from itertools import islice, repeat
from operator import truth

from foundation.sampling_params import SamplingParams
from foundation.structured_output import ConstraintKind, StructuredOutput
from protos.stagemesh.stage.v1 import stage_pb2 as pb
from stage_worker.plan import (
    PlanError,
    StageCachedSeq,
    StageNewSeq,
    StageOutcome,
    StagePlan,
    SteadyBatch,
    little_endian,
)

_new_tuple = tuple.__new__  # builds a StageCachedSeq without the NamedTuple's Python __new__
_SAMPLE, _RUN_AHEAD = 1, 2  # CachedBatch.flags bits
_DECODE_FLAGS = bytes((_SAMPLE | _RUN_AHEAD,))  # one run-ahead decode's flags
_SAMPLE_ONLY = bytes((_SAMPLE,))  # a decode's flags with its input token appended
_ONE_INT32 = (1).to_bytes(4, "little")  # a count of 1, as the columns pack it
_SAMPLE_BIT_ONLY = bytes.maketrans(b"\x02\x03", b"\x00\x01")  # valid flags -> sample bit
_ITEM_NAMES = {"q": "int64", "i": "int32"}  # CachedBatch's item types, by array typecode


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty, presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        min_tokens=msg.min_tokens, banned_until_min=tuple(msg.banned_until_min),
        logit_bias=tuple(zip(msg.logit_bias_ids, msg.logit_bias_values, strict=True)),
        structured=StructuredOutput(ConstraintKind(msg.structured_kind), msg.structured_spec)
        if msg.structured_kind else None,
    )


def plan_from_proto(msg: pb.StepPlan) -> StagePlan:
    """The stage's plan of `msg`.

    Raises:
        PlanError: a malformed cached batch (see `cached_from_proto`).
    """
    new = tuple(
        StageNewSeq(s.seq_id, tuple(s.token_ids), s.prompt_len, tuple(s.block_ids), s.num_computed,
                    s.num_new, s.sample,
                    sampling_from_proto(s.sampling) if s.HasField("sampling") else None)
        for s in msg.new_seqs
    ) if msg.new_seqs else ()
    copies = msg.block_copies
    return StagePlan(msg.step_id, new, cached_from_proto(msg.step_id, msg.cached_batch),
                     tuple(msg.free_seq_ids), tuple((c.src, c.dst) for c in copies)
                     if copies else (), msg.traceparent)


def cached_from_proto(step: int,
                      batch: pb.CachedBatch) -> tuple[StageCachedSeq, ...] | SteadyBatch:
    """The packed columns of `batch` (layout in stage.proto) as one StageCachedSeq per
    sequence, in batch order. The hot path of the conversion (every running sequence, every
    step): each column is unpacked in C, and the tuples are zipped from the columns. A
    steady batch (every sequence one sampled decode, all run-ahead from one step or all
    with one token appended) stays columns (`SteadyBatch`), recognised by comparing bytes.

    Raises:
        PlanError: a column that is not whole items, or whose length disagrees with the
            number of sequences (or, for the flat ids, with the sum of their counts); a flag
            bit that is not defined.
    """
    n, whole = divmod(len(batch.seq_ids), 8)
    flags = batch.flags  # uint8: bytes are their own array
    zeros = bytes(4 * n)  # n int32 zeros: a counts column with nothing appended
    run_ahead = (flags == _DECODE_FLAGS * n and not batch.append_token_ids
                 and batch.append_token_counts == zeros)
    if (n and not whole and len(batch.num_computed) == 4 * n
            and batch.num_new == _ONE_INT32 * n):  # one-token decodes: maybe steady
        decodes = _steady_batch(batch, n, run_ahead, zeros, step)
        if decodes is not None:
            return decodes
    seq_ids = _unpack(batch.seq_ids, "q", step, "seq_ids")
    computed = _per_seq(batch.num_computed, "i", n, step, "num_computed")
    new = _per_seq(batch.num_new, "i", n, step, "num_new")
    blocks = _blocks(batch, n, zeros, step)
    if run_ahead:
        # Every sequence a run-ahead decode, nothing appended, but not a `SteadyBatch` (the
        # run-ahead steps differ, say): the columns of one item per sequence are checked.
        steps = _per_seq(batch.input_from_step, "q", n, step, "input_from_step")
        return tuple(map(_new_tuple, repeat(StageCachedSeq), zip(
            seq_ids, blocks, computed, new, repeat(()), repeat(True), steps)))
    if len(flags) != n:
        raise PlanError(f"step {step}: cached_batch.flags holds {len(flags)} uint8s for {n} "
                        "sequences (seq_ids)")
    tokens = _runs(_per_seq(batch.append_token_counts, "i", n, step, "append_token_counts"),
                   _unpack(batch.append_token_ids, "q", step, "append_token_ids"), step,
                   "append_token")
    from_step = _from_steps(flags, _unpack(batch.input_from_step, "q", step, "input_from_step"),
                            step)
    samples = map(truth, flags.translate(_SAMPLE_BIT_ONLY))  # bools, in C
    columns = zip(seq_ids, blocks, computed, new, tokens, samples, from_step, strict=True)
    return tuple(map(_new_tuple, repeat(StageCachedSeq), columns))


def _steady_batch(batch: pb.CachedBatch, n: int, ahead: bool, zeros: bytes,
                  step: int) -> SteadyBatch | None:
    """`batch` of n one-token decodes (n > 0; its id and num_computed columns of n whole
    items), every one sampled, as a `SteadyBatch` when it is one: all run-ahead from one
    step (`ahead`: the flags and counts say run-ahead, nothing appended), all with one token
    appended, or all with neither (a middle stage's plan); else None.

    Raises:
        PlanError: the block columns, as `_runs`.
    """
    steps, appended = batch.input_from_step, None
    if ahead:
        if len(steps) != 8 * n or steps != steps[:8] * n:  # not one step, n times
            return None
        from_step: int | None = int.from_bytes(steps[:8], "little", signed=True)
    elif batch.flags == _SAMPLE_ONLY * n and not steps:
        from_step, token_counts = None, batch.append_token_counts
        if token_counts == _ONE_INT32 * n and len(batch.append_token_ids) == 8 * n:
            appended = _unpack(batch.append_token_ids, "q", step, "append_token_ids")
        elif token_counts != zeros or batch.append_token_ids:  # zeros: a middle stage's
            return None
    else:
        return None
    counts = ids = None
    if batch.new_block_ids or batch.new_block_counts != zeros:
        counts = _per_seq(batch.new_block_counts, "i", n, step, "new_block_counts")
        ids = _unpack(batch.new_block_ids, "i", step, "new_block_ids")
        _check_runs(counts, ids, step, "new_block")
    return SteadyBatch(batch.seq_ids, batch.num_computed, from_step, counts, ids, appended)


def _blocks(batch: pb.CachedBatch, n: int, zeros: bytes,
            step: int) -> Sequence[tuple[int, ...]]:
    """Each of the `n` sequences' new block ids (most steps: none, which a counts column
    equal to `zeros`, n int32 zeros, says without being unpacked).

    Raises:
        PlanError: as `_runs`, or a counts column that is not n int32s.
    """
    counts = batch.new_block_counts
    if not batch.new_block_ids and counts == zeros:
        return [()] * n
    return _runs(_per_seq(counts, "i", n, step, "new_block_counts"),
                 _unpack(batch.new_block_ids, "i", step, "new_block_ids"), step, "new_block")


def _unpack(data: bytes, typecode: str, step: int, field: str) -> array[int]:
    """Little-endian items of `typecode` from one CachedBatch column.

    Raises:
        PlanError: `data` is not a whole number of items.
    """
    size = array(typecode).itemsize
    if len(data) % size:
        raise PlanError(f"step {step}: cached_batch.{field} holds {len(data)} bytes, not "
                        f"whole {_ITEM_NAMES[typecode]}s ({size} bytes each)")
    return little_endian(data, typecode)


def _per_seq(data: bytes, typecode: str, n: int, step: int, field: str) -> array[int]:
    """A column of one item per sequence.

    Raises:
        PlanError: not whole items, or not `n` of them.
    """
    values = _unpack(data, typecode, step, field)
    if len(values) != n:
        raise PlanError(f"step {step}: cached_batch.{field} holds {len(values)} "
                        f"{_ITEM_NAMES[typecode]}s for {n} sequences (seq_ids)")
    return values


def _runs(counts: array[int], flat: array[int], step: int,
          name: str) -> Sequence[tuple[int, ...]]:
    """`flat` cut into consecutive runs of `counts[i]` ids, one per sequence.

    Raises:
        PlanError: a negative count, or counts that do not sum to the length of `flat`.
    """
    total = _check_runs(counts, flat, step, name)
    if not flat:  # every count is 0 (a middle stage's tokens, most steps' blocks)
        return [()] * len(counts)
    if total == len(counts) and 0 not in counts:  # one id each (a decode's input token)
        return list(zip(flat))
    ids = iter(flat)
    one = ids.__next__
    return [() if not c else (one(),) if c == 1 else tuple(islice(ids, c)) for c in counts]


def _check_runs(counts: array[int], flat: array[int], step: int, name: str) -> int:
    """The sum of `counts`, which cut `flat` into runs (see `_runs`).

    Raises:
        PlanError: a negative count, or counts that do not sum to the length of `flat`.
    """
    if counts and min(counts) < 0:
        raise PlanError(f"step {step}: cached_batch.{name}_counts holds a negative count "
                        f"({min(counts)})")
    total = sum(counts)
    if total != len(flat):
        raise PlanError(f"step {step}: cached_batch.{name}_counts sum to {total}, but "
                        f"{name}_ids holds {len(flat)}")
    return total


def _from_steps(flags: bytes, steps: array[int], step: int) -> Sequence[int | None]:
    """Each sequence's run-ahead step: the next of `steps` where the run-ahead bit is set,
    else None.

    Raises:
        PlanError: a flag bit other than sample and run-ahead, or a run-ahead bit count that
            differs from the number of `steps`.
    """
    if flags and max(flags) > _SAMPLE | _RUN_AHEAD:
        raise PlanError(f"step {step}: cached_batch.flags holds {max(flags):#x}; only bits "
                        f"{_SAMPLE:#x} (sample) and {_RUN_AHEAD:#x} (run-ahead) are defined")
    num_ahead = flags.count(_RUN_AHEAD) + flags.count(_RUN_AHEAD | _SAMPLE)
    if num_ahead != len(steps):
        raise PlanError(f"step {step}: cached_batch.flags marks {num_ahead} sequences "
                        f"run-ahead, but input_from_step holds {len(steps)} steps")
    if not steps:
        return [None] * len(flags)
    if len(steps) == len(flags):  # every sequence run-ahead (decodes, the usual step)
        return steps
    next_step = iter(steps).__next__  # the counts agree: never exhausted
    return [next_step() if f & _RUN_AHEAD else None for f in flags]


def outcome_to_proto(outcome: StageOutcome) -> pb.StepResult:
    """The sampled tokens as packed little-endian int64 arrays; a SampledToken message only
    for the sequences that asked for log probabilities."""
    logprobs = [
        pb.SampledToken(seq_id=t.seq_id, token_id=t.token_id, logprob=t.logprob,
                        top_token_ids=t.top_token_ids, top_logprobs=t.top_logprobs)
        for t in outcome.logprobs
    ]
    prompt = [
        pb.PromptLogprobs(seq_id=p.seq_id, start=p.start, token_ids=p.token_ids,
                          logprobs=p.logprobs,
                          num_top=len(p.top_token_ids[0]) if p.top_token_ids else 0,
                          top_token_ids=[t for top in p.top_token_ids for t in top],
                          top_logprobs=[v for top in p.top_logprobs for v in top])
        for p in outcome.prompt_logprobs
    ]
    return pb.StepResult(step_id=outcome.step_id, tokens=logprobs,
                         kv_blocks_used=outcome.kv_blocks_used,
                         num_sequences=outcome.num_sequences,
                         sampled_seq_ids=pack_int64(outcome.seq_ids),
                         sampled_token_ids=pack_int64(outcome.token_ids),
                         prompt_logprobs=prompt)


def pack_int64(values: Sequence[int]) -> bytes:
    """`values` as little-endian int64, 8 bytes each."""
    packed = array("q", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def error_to_proto(step_id: int, message: str) -> pb.StepResult:
    return pb.StepResult(step_id=step_id, error=message)
