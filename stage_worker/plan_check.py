"""A plan is checked against the stage's limits and held sequences before any rank sees it.

Nothing here touches torch: a plan that would index past the KV pool, overflow the
activations the stage sized for, or contradict what the stage holds is refused with a
`PlanError` that names the step, the sequence and the limit, never as an exception deep in
the model or a device-side assert.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from stage_worker.held_seqs import HeldSeq
from stage_worker.plan import PlanError, StageCachedSeq, StagePlan


@dataclass(frozen=True)
class StepLimits:
    """What one step of this stage may ask for (the values Describe reports).

    max_num_batched_tokens: tokens computed in one step (the profiled activation peak).
    max_num_seqs: sequences computed in one step.
    num_blocks: KV block ids are in [0, num_blocks).
    block_size: tokens per KV block.
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    num_blocks: int
    block_size: int


def check_plan(plan: StagePlan, held: Mapping[int, HeldSeq], limits: StepLimits,
               needs_tokens: bool, knows_samples: bool = False) -> None:
    """Refuse `plan` unless the stage can run it as given. Reads, never mutates.

    Args:
        plan: the step, before its frees are applied.
        held: the sequences the stage holds now.
        limits: the stage's step limits.
        needs_tokens: the stage reads its inputs from token ids (the first stage), so every
            computed token must be known (a run-ahead input counts as known).
        knows_samples: the stage sampled every held sequence's last token (the last stage),
            so a run-ahead input must name the step that sampled it.
    Raises:
        PlanError: too many tokens or sequences, a block id outside the pool, a block table
            too short for its tokens, an unknown or duplicated sequence, a chunk computing
            nothing, a run-ahead input that is not one token from an earlier step (or, on
            the last stage, not the one it sampled last), or (first stage) input tokens the
            stage does not know.
    """
    step = plan.step_id
    if plan.num_tokens > limits.max_num_batched_tokens:
        raise PlanError(f"step {step} computes {plan.num_tokens} tokens, more than this "
                        f"stage's max_num_batched_tokens ({limits.max_num_batched_tokens})")
    if plan.num_seqs > limits.max_num_seqs:
        raise PlanError(f"step {step} computes {plan.num_seqs} sequences, more than this "
                        f"stage's max_num_seqs ({limits.max_num_seqs})")
    _check_block_ids(step, "block copies", [b for pair in plan.block_copies for b in pair],
                     limits.num_blocks)
    freed = set(plan.free_seq_ids)
    seen: set[int] = set()
    for new in plan.new_seqs:
        where = _sequence(step, new.seq_id, seen)
        if new.seq_id in held and new.seq_id not in freed:
            raise PlanError(f"{where} is sent as new but already held")
        _check_block_ids(step, where, new.block_ids, limits.num_blocks)
        _check_chunk(where, new.num_computed, new.num_new, len(new.block_ids), limits)
        if needs_tokens:
            _check_tokens(where, len(new.token_ids), new.num_computed + new.num_new)
    if _cached_pass(plan, held, limits, freed | seen, needs_tokens, knows_samples):
        return
    for cached in plan.cached_seqs:  # a diff is refused: find the first, and say why
        seq_id = cached.seq_id
        state = None if seq_id in freed else held.get(seq_id)
        if state is None or seq_id in seen:
            where = _sequence(step, seq_id, seen)
            raise PlanError(f"{where} is not held by this stage")
        seen.add(seq_id)
        _check_cached(step, cached, state, limits, needs_tokens, knows_samples)


def _cached_pass(plan: StagePlan, held: Mapping[int, HeldSeq], limits: StepLimits,
                 taken: set[int], needs_tokens: bool, knows_samples: bool) -> bool:
    """Whether every diff of `plan` names a held sequence once (none of `taken`: freed, or
    sent as new) and passes `_check_cached`: the same conditions in one pass over the diffs
    (the hot loop: every running sequence, every step), without saying which one fails."""
    cached = plan.cached_seqs
    seq_ids = [c[0] for c in cached]
    if len(set(seq_ids)) != len(seq_ids) or not taken.isdisjoint(seq_ids):
        return False
    step, num_blocks, block_size, get = plan.step_id, limits.num_blocks, limits.block_size, held.get
    for seq_id, blocks, start, num_new, appended, _, from_step in cached:
        state = get(seq_id)
        if state is None:
            return False
        end = start + num_new
        if (num_new < 1 or start < 0
                or (len(state.block_table) + len(blocks)) * block_size < end
                or (blocks and (min(blocks) < 0 or max(blocks) >= num_blocks))):
            return False
        if from_step is None:
            known = len(state.token_ids) + len(appended)
        elif (num_new != 1 or appended or not 0 <= from_step < step
              or (knows_samples and state.last_sample_step != from_step)):
            return False
        else:
            known = len(state.token_ids) + 1
        if needs_tokens and known < end:
            return False
    return True


def _check_cached(step: int, cached: StageCachedSeq, state: HeldSeq, limits: StepLimits,
                  needs_tokens: bool, knows_samples: bool) -> None:
    """One held sequence's diff (the hot loop: a message is formatted only to refuse)."""
    blocks, end = cached.new_block_ids, cached.num_computed + cached.num_new
    num_blocks = len(state.block_table) + len(blocks)
    if blocks and (min(blocks) < 0 or max(blocks) >= limits.num_blocks):
        _check_block_ids(step, _where(step, cached), blocks, limits.num_blocks)
    if cached.num_new < 1 or cached.num_computed < 0 or num_blocks * limits.block_size < end:
        _check_chunk(_where(step, cached), cached.num_computed, cached.num_new, num_blocks,
                     limits)
    known = len(state.token_ids) + len(cached.append_token_ids)
    if cached.input_from_step is not None:
        _check_run_ahead(step, cached, state if knows_samples else None)
        known = len(state.token_ids) + 1
    if needs_tokens and known < end:
        _check_tokens(_where(step, cached), known, end)


def _where(step: int, cached: StageCachedSeq) -> str:
    return f"step {step}, sequence {cached.seq_id}"


def _sequence(step: int, seq_id: int, seen: set[int]) -> str:
    """"step S, sequence N" for messages; refuses a sequence listed twice in one plan."""
    where = f"step {step}, sequence {seq_id}"
    if seq_id in seen:
        raise PlanError(f"{where} is listed twice")
    seen.add(seq_id)
    return where


def _check_block_ids(step: int, where: str, ids: Iterable[int], num_blocks: int) -> None:
    ids = tuple(ids)
    if ids and (min(ids) < 0 or max(ids) >= num_blocks):
        bad = next(b for b in ids if not 0 <= b < num_blocks)
        where = where if where.startswith("step") else f"step {step}, {where}"
        raise PlanError(f"{where}: block id {bad} is outside this stage's KV pool "
                        f"[0, {num_blocks}) (num_blocks {num_blocks})")


def _check_chunk(where: str, num_computed: int, num_new: int, num_blocks: int,
                 limits: StepLimits) -> None:
    if num_new < 1 or num_computed < 0:
        raise PlanError(f"{where} computes {num_new} tokens after {num_computed}")
    end = num_computed + num_new
    if num_blocks * limits.block_size < end:
        raise PlanError(f"{where}: {num_blocks} blocks cannot hold {end} tokens "
                        f"(block size {limits.block_size})")


def _check_run_ahead(step: int, cached: StageCachedSeq, sampled: HeldSeq | None) -> None:
    """A run-ahead input: one token, none appended, sampled at an earlier step (and, where
    `sampled` is given, the step that sampled the sequence last)."""
    k = cached.input_from_step
    if cached.num_new != 1 or cached.append_token_ids:
        raise PlanError(f"{_where(step, cached)} takes its input from step {k} but computes "
                        f"{cached.num_new} tokens and appends {len(cached.append_token_ids)}")
    if k is None or not 0 <= k < step:
        raise PlanError(f"{_where(step, cached)} takes its input from step {k}, not an "
                        "earlier step")
    if sampled is not None and sampled.last_sample_step != k:
        raise PlanError(f"{_where(step, cached)} takes its input from step {k}, but this stage "
                        f"last sampled it at step {sampled.last_sample_step}")


def _check_tokens(where: str, known: int, needed: int) -> None:
    if known < needed:
        raise PlanError(f"{where}: the first stage knows {known} tokens, the step computes "
                        f"up to token {needed}")
