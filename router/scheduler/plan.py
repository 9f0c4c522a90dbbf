"""What the scheduler sends down (``StepPlan``) and hands back after a result (``StepUpdate``).

Protocol for a stage receiving plan ``k`` (plans arrive and run in ``step_id`` order):
  1. drop the per-sequence state of ``finished_seq_ids``, ``aborted_seq_ids`` and
     ``preempted_seq_ids`` (a preempted sequence may come back later as new, in full; after
     ``Scheduler.preempt_all`` the ids may name sequences whose plan was lost with a failed
     stage, which a stage drops quietly if it never had them);
  2. apply ``block_copies`` (before anything of step ``k`` writes KV);
  3. add ``new_seqs`` (state keyed by ``seq_id``);
  4. compute, for every sequence of the step, positions
     ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``, writing their KV into the
     slots the block table gives; the last stage samples one token for each ``sample`` entry.
The result must carry exactly one token per ``sample`` entry, keyed by ``seq_id``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from kvcache import BlockCopy


@dataclass(frozen=True, slots=True)
class NewSeq:
    """A sequence the stages do not know: sent in full, once per stay in the running set.

    Attributes:
        seq_id: the sequence.
        token_ids: every known token (prompt, or prompt + generated after a preemption).
        prompt_len: how many of ``token_ids`` are the prompt (the rest were generated before
            a preemption); the last stage counts outputs from it (penalties, seeded draws).
        sampling: the caller's opaque sampling object, for the last stage.
        block_ids: the whole block table.
        num_computed_tokens: positions whose KV already exists (prefix-cache hits, shared
            blocks of a fork); the step computes from here.
        num_new_tokens: positions this step computes: ``token_ids[num_computed_tokens:][:n]``.
        sample: whether the last stage samples after this step (False for a non-final chunk).
    """

    seq_id: int
    token_ids: tuple[int, ...]
    prompt_len: int
    sampling: object
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_new_tokens: int
    sample: bool


class CachedSeq(NamedTuple):
    """A diff for a sequence the stages already hold.

    A stage keeps the sequence's token history (from ``NewSeq.token_ids``), appends
    ``new_token_ids`` to it (or, with ``input_from_step``, the token that arrives over the data
    plane), and takes the step's inputs from the history:
    ``history[num_computed_tokens : num_computed_tokens + num_new_tokens]``.

    A NamedTuple, not a dataclass: a step carries hundreds of these and construction cost is
    the scheduler's hot path. Immutable all the same.

    Attributes:
        seq_id: the sequence.
        new_block_ids: blocks appended to its table since the last plan that named it.
        num_computed_tokens: positions whose KV exists or is scheduled in an earlier step.
        num_new_tokens: positions this step computes.
        new_token_ids: tokens to append to the history, in order: for a decode its input
            (the token sampled last); for a later prefill chunk none (the prompt came whole).
        input_from_step: run-ahead: the single input, to append to the history too, is the
            token the last stage sampled for this sequence at that step (it reaches stage 0
            over the data plane, not in the plan); else None.
        sample: whether the last stage samples after this step.
    """

    seq_id: int
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_new_tokens: int
    new_token_ids: tuple[int, ...]
    input_from_step: int | None
    sample: bool


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step for every stage. See the module docstring for the order of application.

    Attributes:
        step_id: monotonic; a plan with no sequences still carries notices and copies and is
            answered by an (empty) result like any other.
        new_seqs: sequences sent in full.
        cached_seqs: diffs for sequences the stages hold.
        finished_seq_ids: ended normally (EOS, stop string, length); stages drop their state.
        aborted_seq_ids: cancelled; stages drop their state.
        preempted_seq_ids: blocks taken back; stages drop their state (it may return as new).
        block_copies: block copies to make before the step writes any KV.
    """

    step_id: int
    new_seqs: tuple[NewSeq, ...]
    cached_seqs: tuple[CachedSeq, ...]
    finished_seq_ids: tuple[int, ...] = ()
    aborted_seq_ids: tuple[int, ...] = ()
    preempted_seq_ids: tuple[int, ...] = ()
    block_copies: tuple[BlockCopy, ...] = ()

    @property
    def seq_ids(self) -> tuple[int, ...]:
        """Every sequence the step computes (new first, then cached)."""
        return (*(s.seq_id for s in self.new_seqs), *(s.seq_id for s in self.cached_seqs))

    @property
    def freed_seq_ids(self) -> tuple[int, ...]:
        """Every sequence whose stage state this plan drops."""
        return (*self.finished_seq_ids, *self.aborted_seq_ids, *self.preempted_seq_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Positions computed by the step, all sequences together."""
        return sum(s.num_new_tokens for s in self.new_seqs) + sum(
            s.num_new_tokens for s in self.cached_seqs
        )

    @property
    def sampling_seq_ids(self) -> tuple[int, ...]:
        """Sequences the last stage samples for; a result has exactly these keys."""
        return (*(s.seq_id for s in self.new_seqs if s.sample),
                *(s.seq_id for s in self.cached_seqs if s.sample))


@dataclass(frozen=True, slots=True)
class StepUpdate:
    """What ``Scheduler.update`` did with a step's result.

    Attributes:
        step_id: the step.
        new_tokens: seq_id -> token appended to that sequence (the caller now checks stop
            rules and streams them, and reports finishes through ``Scheduler.finish``).
        discarded_seq_ids: sequences whose sampled token was dropped because they finished,
            were aborted or were preempted after the step was planned.
        length_capped_seq_ids: sequences the scheduler finished (reason LENGTH) because they
            reached ``max_model_len``; their token is in ``new_tokens``.
    """

    step_id: int
    new_tokens: Mapping[int, int]
    discarded_seq_ids: tuple[int, ...]
    length_capped_seq_ids: tuple[int, ...]
