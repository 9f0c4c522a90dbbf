"""A step plan as the stage sees it (domain objects; protos are converted in `convert`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter
from typing import NamedTuple

from foundation.sampling_params import SamplingParams

_NUM_NEW = attrgetter("num_new")  # of a StageNewSeq or a StageCachedSeq


class PlanError(ValueError):
    """A plan the stage refuses: it contradicts the stage's state (unknown or duplicate
    sequence, short block table) or exceeds what the stage sized for (tokens, sequences,
    block ids). The message names the step, the sequence and the limit. The stage fails
    that step loudly rather than guessing."""


@dataclass(frozen=True)
class StageNewSeq:
    """A sequence sent to the stage in full: on first schedule, and again after a preemption."""

    seq_id: int
    token_ids: tuple[int, ...]  # prompt + earlier outputs; may be empty on middle stages
    prompt_len: int
    block_ids: tuple[int, ...]
    num_computed: int
    num_new: int
    sample: bool
    sampling: SamplingParams | None  # read by the last stage only


class StageCachedSeq(NamedTuple):
    """A sequence the stage holds, continued as a diff (a NamedTuple: a step carries
    hundreds of these, and building them is on every step's path).

    append_token_ids: tokens sampled since the previous plan (the first stage's inputs).
    input_from_step: run-ahead: the step's one input is the token the last stage sampled
        for this sequence at that step (it reaches the first stage over the data plane and
        is appended to the history like `append_token_ids`, which is then empty); None
        otherwise.
    """

    seq_id: int
    new_block_ids: tuple[int, ...]
    num_computed: int
    num_new: int
    append_token_ids: tuple[int, ...]
    sample: bool
    input_from_step: int | None = None


@dataclass(frozen=True)
class StagePlan:
    """One step. Batch order: new_seqs, then cached_seqs."""

    step_id: int
    new_seqs: tuple[StageNewSeq, ...]
    cached_seqs: tuple[StageCachedSeq, ...]
    free_seq_ids: tuple[int, ...]
    block_copies: tuple[tuple[int, int], ...] = ()  # (src, dst), applied before the step
    traceparent: str = ""  # a traced request's trace context: the step is a span of it

    @cached_property
    def num_tokens(self) -> int:
        return sum(map(_NUM_NEW, self.new_seqs)) + sum(map(_NUM_NEW, self.cached_seqs))

    @property
    def num_seqs(self) -> int:
        return len(self.new_seqs) + len(self.cached_seqs)


@dataclass(frozen=True)
class SampledToken:
    """A sampled token with its log probability and the most likely alternatives (most
    likely first); reported only for sequences whose sampling settings asked for them."""

    seq_id: int
    token_id: int
    logprob: float = 0.0
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """Log probabilities of a stretch of one sequence's prompt, from one step's chunk.

    Entry i scores the prompt token at position `start + i` (>= 1) given the tokens before
    it: its id, its log probability and the `k` most likely tokens at that position (most
    likely first), for sequences whose settings ask for `prompt_logprobs=k`.
    """

    seq_id: int
    start: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_token_ids: tuple[tuple[int, ...], ...]
    top_logprobs: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class StageOutcome:
    """What a stage reports after a step.

    seq_ids / token_ids: on the last stage, the token sampled for every sampling sequence,
        in batch order (aligned); empty elsewhere.
    logprobs: one record per sampling sequence that asked for log probabilities.
    prompt_logprobs: on the last stage, one record per chunk of the step that computed
        prompt positions of a sequence asking for prompt log probabilities.
    """

    step_id: int
    seq_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[SampledToken, ...]
    kv_blocks_used: int
    num_sequences: int
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()

    @property
    def sampled(self) -> dict[int, int]:
        """seq_id -> the token sampled for it."""
        return dict(zip(self.seq_ids, self.token_ids, strict=True))
