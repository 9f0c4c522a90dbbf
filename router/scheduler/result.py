"""Applying a step's result: the one place sampled tokens enter the scheduler."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

from router.scheduler.errors import InvalidStepResultError
from router.scheduler.inflight import InflightStep
from router.scheduler.plan import StepUpdate
from router.scheduler.sequence import FinishReason, Sequence
from router.scheduler.state import SchedulerState


def apply_step_result(
    state: SchedulerState, step_id: int, sampled: Mapping[int, int]
) -> StepUpdate:
    """Apply ``sampled`` (seq_id -> token) to exactly the sequences of step ``step_id``.

    See ``Scheduler.update``. Validates everything before changing anything.
    """
    step = state.inflight.oldest(step_id)
    sequences = step.sampling
    try:  # validates and looks up in one pass; nothing is changed before it succeeds
        tokens_in_order = [sampled[seq.seq_id] for seq in sequences]
    except KeyError:
        tokens_in_order = []
    if len(tokens_in_order) != len(sequences) or len(sampled) != len(sequences):
        _raise_mismatch(step, sampled)
    state.inflight.pop_oldest()
    stale = step.stale
    max_len = state.config.max_model_len
    new_tokens = dict(sampled) if not stale else {}
    discarded: list[int] = []
    capped: list[Sequence] = []
    for seq, token in zip(sequences, tokens_in_order, strict=True):
        if stale and seq.seq_id in stale:
            discarded.append(seq.seq_id)
            continue
        tokens = seq.token_ids
        tokens.append(token)
        seq.num_pending -= 1
        seq.num_inflight -= 1
        if stale:
            new_tokens[seq.seq_id] = token
        num_known, end = len(tokens), seq.num_computed
        if num_known >= max_len:
            capped.append(seq)
        elif (end if end < num_known else num_known) >= seq.next_cache_at:  # as in _emit
            state.cache_full_blocks(seq)  # run-ahead: its position was scheduled already
    for seq in step.silent:
        if stale and seq.seq_id in stale:
            continue
        seq.num_inflight -= 1
        if seq.extra_choices and not seq.num_inflight and seq.num_computed == seq.compute_limit:
            state.fork_ready.append(seq)
    for seq in capped:
        state.release(seq, FinishReason.LENGTH)
    return StepUpdate(step_id, new_tokens, tuple(discarded), tuple(s.seq_id for s in capped))


def _raise_mismatch(step: InflightStep, sampled: Mapping[int, int]) -> NoReturn:
    expected = {s.seq_id for s in step.sampling}
    missing = sorted(expected - sampled.keys())
    unexpected = sorted(sampled.keys() - expected)
    raise InvalidStepResultError(
        f"step {step.step_id}: tokens missing for {missing}, unexpected for {unexpected}")
