"""The sequences a stage holds between plans, keyed by sequence id.

Every TP rank of a stage applies the same plans, so they hold the same sequences. Only the
first stage (its input ids) and the last (penalties and seeded draws read the prompt and the
outputs) keep token ids; a middle stage keeps block tables and counts only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from foundation.sampling_params import SamplingParams
from stage_worker.plan import StageCachedSeq, StagePlan
from stage_worker.step_input import SeqChunk

_new_tuple = tuple.__new__  # a SeqChunk from a tuple, without the NamedTuple's Python __new__


@dataclass(slots=True)
class HeldSeq:
    """One sequence's state on this stage (not the router's sequence: only what a stage
    needs to compute and sample its next steps)."""

    seq_id: int
    block_table: list[int]
    token_ids: list[int]  # known tokens (first and last stage); always empty elsewhere
    prompt_len: int
    num_outputs: int  # tokens generated so far: the index of the next sampled token
    sampling: SamplingParams | None  # last stage only
    output_ids: list[int] = field(default_factory=list)  # outputs (last stage only)
    last_sample_step: int = -1  # the step that sampled output_ids[-1] (last stage only)
    # Structured output (last stage): the sequence's llguidance matcher, made on its first
    # sampling step, and how many of output_ids it has consumed (`stage_worker.structured`).
    grammar: Any = None
    grammar_consumed: int = 0
    # Prompt log probabilities asked (last stage): positions below this score the prompt
    # token after them (prompt_len - 1); 0 when not asked.
    score_prompt_below: int = 0

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.prompt_len]


class LaneAhead(NamedTuple):
    """A lane's run-ahead step on the first stage (`Lanes.apply`, deferred): every row of
    the step is the run-ahead input of `seq_ids[row]`, sampled at `step_id`, and each of
    `histories` (the sequences' token ids, in that order) ends with its placeholder."""

    seq_ids: tuple[int, ...]
    step_id: int
    histories: list[list[int]]


@dataclass
class StepInputs:
    """What a plan asks of this stage, in batch order.

    chunks: every sequence's share of the step.
    input_ids: where inputs are built (`HeldSeqs.builds_inputs`), the step's input token
        ids [T]; empty elsewhere.
    ahead: where inputs are built, (row in input_ids, seq_id, step) of every run-ahead
        input: the token that step sampled for the sequence; empty elsewhere.
    lane_ahead: in place of `ahead`, a lane's step whose every row is a run-ahead input
        waiting for its token (its placeholders are not in `HeldSeqs`' records: the step's
        late fill writes them, `StageRank.step`).
    """

    chunks: list[SeqChunk]
    input_ids: list[int]
    ahead: list[tuple[int, int, int]]
    lane_ahead: LaneAhead | None = None

    def add(self, state: HeldSeq, num_computed: int, num_new: int, sample: bool,
            with_inputs: bool) -> None:
        """Append `state`'s chunk of [num_computed, num_computed + num_new) and, with
        `with_inputs`, its inputs."""
        self.chunks.append(SeqChunk(state.seq_id, num_computed, num_new, state.block_table,
                                    sample, _prompt_rows(state, num_computed, num_new)))
        if with_inputs:
            self.input_ids += state.token_ids[num_computed:num_computed + num_new]


class HeldSeqs:
    """Applies plans: frees, new sequences and diffs, in that order.

    Mutates its table of sequences; `block_refs` counts each block's users so KV usage is
    known in O(1). `keep_tokens` False (a middle stage) stores no token ids whatever the
    plan carries. `builds_inputs` (default: `keep_tokens`; never without it): `apply` lays
    out the step's input token ids and run-ahead rows (the first stage reads them; the last
    keeps tokens for sampling only).
    """

    def __init__(self, keep_tokens: bool = True, builds_inputs: bool | None = None) -> None:
        self.keep_tokens = keep_tokens
        self.builds_inputs = keep_tokens and (builds_inputs is None or builds_inputs)
        self.seqs: dict[int, HeldSeq] = {}
        self.block_refs: Counter[int] = Counter()
        # seq_id -> index in its token_ids of a run-ahead input applied before the step that
        # sampled it was resolved (`apply(..., deferred=True)`); `record_sampled` fills it.
        self._unfilled: dict[int, int] = {}

    @property
    def kv_blocks_used(self) -> int:
        return len(self.block_refs)

    def apply(self, plan: StagePlan, fed: Mapping[int, int] | None = None,
              deferred: bool = False) -> StepInputs:
        """Update the held sequences for `plan`, which `plan_check.check_plan` accepted.

        `fed`: where tokens are kept, the token of every run-ahead sequence of the plan
        (seq_id -> the token sampled at its `input_from_step`), appended to its history as
        if it had come in `append_token_ids`. `deferred`: a run-ahead sequence missing from
        `fed` was sampled by a step whose tokens are still on the device; its history gets
        a placeholder (and its input row token 0, which the caller overwrites on the device)
        that `record_sampled` of that step fills.
        """
        for seq_id in plan.free_seq_ids:
            self.free(seq_id)
        keep = self.keep_tokens
        inputs = StepInputs([], [], [])
        for new in plan.new_seqs:
            tokens = list(new.token_ids) if keep else []
            outputs = tokens[new.prompt_len:]
            state = HeldSeq(new.seq_id, list(new.block_ids), tokens, new.prompt_len,
                            max(0, len(new.token_ids) - new.prompt_len),
                            new.sampling if keep else None, outputs)
            if keep and new.sampling is not None and new.sampling.prompt_logprobs is not None:
                state.score_prompt_below = new.prompt_len - 1
            self.seqs[new.seq_id] = state
            self.block_refs.update(new.block_ids)
            inputs.add(state, new.num_computed, new.num_new, new.sample, self.builds_inputs)
        self._apply_cached(plan.cached_seqs, inputs, fed or {}, deferred)
        return inputs

    def _apply_cached(self, cached_seqs: Sequence[StageCachedSeq], inputs: StepInputs,
                      fed: Mapping[int, int], deferred: bool) -> None:
        """`apply`'s diffs of held sequences, appended to `inputs`: the hot loop (every
        running sequence, every step), so fields are unpacked once and chunks are built
        without `SeqChunk`'s Python constructor. A one-token input is read by index: the
        check made sure the first stage knows it."""
        seqs, refs, keep, unfilled = self.seqs, self.block_refs, self.keep_tokens, self._unfilled
        chunks, input_ids, ahead = inputs.chunks, inputs.input_ids, inputs.ahead
        with_inputs = self.builds_inputs
        for seq_id, new_blocks, start, num_new, appended, sample, from_step in cached_seqs:
            state = seqs[seq_id]
            table = state.block_table
            if new_blocks:
                table += new_blocks
                refs.update(new_blocks)
            if keep:
                tokens = state.token_ids
                if from_step is not None:
                    if with_inputs:
                        ahead.append((len(input_ids), seq_id, from_step))
                    token = fed.get(seq_id)
                    if token is None:
                        assert deferred, "a run-ahead input needs its token"
                        unfilled[seq_id] = len(tokens)
                        token = 0
                    tokens.append(token)
                elif appended:
                    tokens += appended
                if with_inputs:
                    if num_new == 1:
                        input_ids.append(tokens[start])
                    else:
                        input_ids += tokens[start:start + num_new]
            rows = (0 if start >= state.score_prompt_below
                    else _prompt_rows(state, start, num_new))
            chunks.append(_new_tuple(SeqChunk, (seq_id, start, num_new, table, sample, rows)))

    def record_sampled(self, step_id: int, seq_ids: Sequence[int],
                       token_ids: Sequence[int]) -> None:
        """The last stage sampled `token_ids[i]` for `seq_ids[i]` at `step_id` (penalties
        and seeded draws read them; a run-ahead input names the step). Sequences freed
        since (a later plan applied before this step was resolved) are skipped."""
        seqs, unfilled = self.seqs, self._unfilled
        for seq_id, token_id in zip(seq_ids, token_ids, strict=True):
            state = seqs.get(seq_id)
            if state is None:
                continue
            state.output_ids.append(token_id)
            state.num_outputs += 1
            state.last_sample_step = step_id
            if unfilled:
                index = unfilled.pop(seq_id, None)
                if index is not None:
                    state.token_ids[index] = token_id

    def defer(self, seq_ids: Sequence[int], indices: Iterable[int]) -> None:
        """`seq_ids[i]`'s history holds a placeholder at `indices[i]`, a run-ahead input
        applied before the step that sampled it was resolved: `record_sampled` fills it."""
        self._unfilled.update(zip(seq_ids, indices, strict=True))

    def fill_inputs(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> None:
        """The first stage of several learned the run-ahead tokens of a step it applied
        with `deferred` (`token_ids[i]` is `seq_ids[i]`'s): they replace the placeholders
        in the histories."""
        seqs, unfilled = self.seqs, self._unfilled
        for seq_id, token_id in zip(seq_ids, token_ids, strict=True):
            index = unfilled.pop(seq_id, None)
            if index is not None:
                seqs[seq_id].token_ids[index] = token_id

    def note_sampling(self, step_id: int, seq_ids: Sequence[int]) -> None:
        """`step_id` is sampling `seq_ids` on the device: a plan may name it as their
        run-ahead step before `record_sampled` brings the tokens."""
        seqs = self.seqs
        for seq_id in seq_ids:
            seqs[seq_id].last_sample_step = step_id

    def free(self, seq_id: int) -> None:
        """Forget a sequence (unknown ids are ignored: frees are idempotent)."""
        state = self.seqs.pop(seq_id, None)
        if state is None:
            return
        self._unfilled.pop(seq_id, None)
        self.block_refs.subtract(state.block_table)
        for block in set(state.block_table):
            if self.block_refs[block] <= 0:
                del self.block_refs[block]

    def clear(self) -> int:
        """Forget every sequence; returns how many there were."""
        dropped = len(self.seqs)
        self.seqs.clear()
        self.block_refs.clear()
        self._unfilled.clear()
        return dropped


def _prompt_rows(state: HeldSeq, num_computed: int, num_new: int) -> int:
    """How many leading rows of the chunk [num_computed, num_computed + num_new) score the
    prompt token after them (see `SeqChunk.prompt_rows`)."""
    return max(0, min(num_computed + num_new, state.score_prompt_below) - num_computed)
