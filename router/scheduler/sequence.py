"""One sequence as the scheduler tracks it, and the enums of its life."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum

from kvcache import BlockHashChain

NEVER = sys.maxsize
"""A token count no sequence reaches: ``Sequence.next_cache_at`` while it holds no blocks
(the KV manager's ``cache_threshold`` when prefix caching is off)."""


class SeqState(Enum):
    """Where a sequence is. Transitions: WAITING -> RUNNING -> (WAITING on preemption) ...
    -> FINISHED; an extra choice starts CHOICE_PENDING and becomes RUNNING when forked."""

    WAITING = "waiting"  # in the waiting queue, holds no blocks (new or preempted)
    RUNNING = "running"  # holds blocks; prefilling or decoding; maybe in flight
    CHOICE_PENDING = "choice_pending"  # extra choice of a request whose prompt is not done yet
    FINISHED = "finished"  # gone; its blocks are freed


class FinishReason(Enum):
    """Why a sequence (a choice of a request) ended: the router's one finish reason.

    Values are OpenAI's ``finish_reason`` strings. The caller reports STOP and ABORT through
    ``Scheduler.finish`` / ``abort``; the scheduler itself ends a sequence with LENGTH when it
    reaches ``max_model_len``.
    """

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the model's context is full
    ABORT = "abort"  # client cancel, deadline, disconnect, or the server failed the request


class NoticeKind(Enum):
    """What the next plan tells the stages about a sequence they know."""

    FINISHED = "finished"
    ABORTED = "aborted"
    PREEMPTED = "preempted"


@dataclass(frozen=True)
class ChoiceSpec:
    """An extra choice (``n > 1``) of a request: its sequence id and opaque sampling object."""

    seq_id: int
    sampling: object


class Sequence:
    """Mutable scheduler-side state of one sequence (identity equality; hot-path slots).

    Token accounting (invariants checked by ``SchedulerState.check_integrity``):
      * ``token_ids`` are the tokens the router knows: prompt, then generated.
      * ``num_pending`` tokens have been sampled by steps still in flight and are not known
        yet; ``num_total = len(token_ids) + num_pending``.
      * ``num_computed`` positions have their KV written or scheduled in a sent step;
        ``num_computed <= num_total`` and ``num_computed <= num_slots``.
      * A sequence is a decode when ``num_computed == num_total - 1``: its one input is the
        last token, known (``token_ids[-1]``) or pending (sampled at ``last_sample_step``).

    Blocks (the ``KVCacheManager`` owns them; the integrity check compares these counts with
    its answers): while running, the sequence holds ``num_slots`` slots, the stages have been
    sent its first ``num_block_ids_sent`` block ids, and its next full block can be registered
    in the prefix cache once ``next_cache_at`` of its tokens are known and scheduled. Waiting,
    it holds none (``num_slots == 0``, ``next_cache_at == NEVER``).
    """

    __slots__ = (
        "arrival", "extra_choices", "free_notice_pending", "hash_chain", "known_to_stages",
        "last_sample_step", "last_step_id", "next_cache_at", "num_block_ids_sent",
        "num_computed", "num_inflight", "num_pending", "num_preemptions", "num_prompt_tokens",
        "num_slots", "num_tokens_sent", "order_key", "parent", "priority", "reads_cache",
        "sampling", "seq_id", "state", "token_ids",
    )

    def __init__(self, seq_id: int, token_ids: list[int], sampling: object, priority: int,
                 order_key: tuple[int, int, int], hash_chain: BlockHashChain) -> None:
        self.seq_id = seq_id
        self.token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.sampling = sampling
        self.reads_cache = True  # False: every prompt position is computed (prompt logprobs)
        self.priority = priority
        self.order_key = order_key  # (priority, arrival, choice index): lower runs first
        self.arrival = order_key[1]
        self.hash_chain = hash_chain  # survives preemption: the history only grows
        self.state = SeqState.WAITING
        self.num_slots = 0
        self.next_cache_at = NEVER
        self.num_computed = 0
        self.num_pending = 0
        self.num_inflight = 0  # outstanding steps that include this sequence (<= 2)
        self.last_step_id = -1
        self.last_sample_step = -1
        self.known_to_stages = False  # sent as new since it last held blocks
        self.num_block_ids_sent = 0
        # Tokens in the stages' copy of the history: sent, or due over the data plane (a
        # run-ahead input). known_to_stages => num_computed <= num_tokens_sent <= num_total.
        self.num_tokens_sent = 0
        self.free_notice_pending = False  # stages not yet told it was preempted
        self.num_preemptions = 0
        self.extra_choices: list[Sequence] = []  # CHOICE_PENDING siblings forked off this one
        self.parent: Sequence | None = None  # set while CHOICE_PENDING

    @property
    def num_total(self) -> int:
        """Known plus pending tokens."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        """Known generated tokens."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def compute_limit(self) -> int:
        """Positions to compute before the fork point: ``num_total`` normally, one less while
        extra choices wait (each choice then computes the last prompt token itself)."""
        return self.num_total - 1 if self.extra_choices else self.num_total

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.state.value}, tokens={len(self.token_ids)}"
                f"+{self.num_pending}, computed={self.num_computed}, "
                f"inflight={self.num_inflight})")
