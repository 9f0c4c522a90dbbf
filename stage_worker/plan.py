"""A step plan as the stage sees it (domain objects; protos are converted in `convert`)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import islice, repeat
from operator import attrgetter
from typing import NamedTuple, overload

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


_new_tuple = tuple.__new__  # builds a StageCachedSeq without the NamedTuple's Python __new__


def little_endian(data: bytes, typecode: str) -> array[int]:
    """Whole little-endian items of `typecode` from `data`, in this host's byte order."""
    values = array(typecode)
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values


class SteadyBatch(Sequence[StageCachedSeq]):
    """A cached batch in which every sequence is one sampled decode, all run-ahead from the
    same step, all with their input token appended, or (a middle stage's) all without
    inputs: the usual step of steady decode, kept as the columns it came in. It reads as
    the `StageCachedSeq` tuple it stands for, built on first use; a stage that continues an
    earlier batch of the same sequences by one token reads only the columns
    (`stage_worker.lanes`), and never builds the tuples.

    seq_key / computed_key: the sequence ids and num_computed columns as they came on the
    wire (little-endian int64 / int32, whole items, one per sequence), compared as bytes;
    `seq_ids` / `num_computed` unpack them when the tuples are built.
    from_step: every sequence's run-ahead step; or None, and `appended` holds each one's
    input token (the router had it when it planned the step), or is None too (a middle
    stage's plan: its inputs are activations).
    block_counts / block_ids: the blocks appended, a count per sequence and the ids one
    after another (counts checked: none negative, their sum the ids'); None / empty when
    no sequence opens a block.
    """

    __slots__ = ("_items", "appended", "block_counts", "block_ids", "computed_key",
                 "from_step", "seq_key")

    def __init__(self, seq_key: bytes, computed_key: bytes, from_step: int | None,
                 block_counts: array[int] | None = None, block_ids: array[int] | None = None,
                 appended: array[int] | None = None) -> None:
        if from_step is not None and appended is not None:
            raise ValueError("a steady batch's inputs are run-ahead (from_step) or appended "
                             "tokens, not both")
        self.seq_key = seq_key
        self.computed_key = computed_key
        self.from_step = from_step
        self.appended = appended
        self.block_counts = block_counts
        self.block_ids = block_ids if block_ids is not None else array("i")
        self._items: tuple[StageCachedSeq, ...] | None = None

    @property
    def seq_ids(self) -> array[int]:
        return little_endian(self.seq_key, "q")

    @property
    def num_computed(self) -> array[int]:
        return little_endian(self.computed_key, "i")

    def blocks(self) -> Sequence[tuple[int, ...]]:
        """Each sequence's new block ids (batch order)."""
        counts = self.block_counts
        if counts is None:
            return [()] * len(self)
        ids = iter(self.block_ids)
        return [tuple(islice(ids, c)) for c in counts]

    def items(self) -> tuple[StageCachedSeq, ...]:
        """The batch as one `StageCachedSeq` per sequence (built once)."""
        if self._items is None:
            tokens = repeat(()) if self.appended is None else zip(self.appended)
            self._items = tuple(map(_new_tuple, repeat(StageCachedSeq), zip(
                self.seq_ids, self.blocks(), self.num_computed, repeat(1), tokens,
                repeat(True), repeat(self.from_step))))
        return self._items

    def __len__(self) -> int:
        return len(self.seq_key) // 8

    @overload
    def __getitem__(self, index: int) -> StageCachedSeq: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[StageCachedSeq, ...]: ...

    def __getitem__(self, index: int | slice) -> StageCachedSeq | tuple[StageCachedSeq, ...]:
        return self.items()[index]

    def __iter__(self) -> Iterator[StageCachedSeq]:
        return iter(self.items())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SteadyBatch | tuple):
            return self.items() == (other if isinstance(other, tuple) else other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SteadyBatch({self.items()!r})"


@dataclass(frozen=True)
class StagePlan:
    """One step. Batch order: new_seqs, then cached_seqs (a tuple, or the columns of a
    steady batch, which read as one)."""

    step_id: int
    new_seqs: tuple[StageNewSeq, ...]
    cached_seqs: tuple[StageCachedSeq, ...] | SteadyBatch
    free_seq_ids: tuple[int, ...]
    block_copies: tuple[tuple[int, int], ...] = ()  # (src, dst), applied before the step
    traceparent: str = ""  # a traced request's trace context: the step is a span of it

    @cached_property
    def num_tokens(self) -> int:
        cached = self.cached_seqs  # a steady batch: one token a sequence
        return sum(map(_NUM_NEW, self.new_seqs)) + (
            len(cached) if isinstance(cached, SteadyBatch) else sum(map(_NUM_NEW, cached)))

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
