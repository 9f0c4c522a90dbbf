"""One live request on a front: its choices, what its stream has not taken yet, and where
its time went."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.choice import ChoiceState
from router.outputs import (
    ChoiceDelta,
    PromptLogprobs,
    RequestTiming,
    StreamItem,
    TokenLogprob,
)
from router.requests import GenerateRequest


@dataclass
class RequestState:
    """One live request. `outbox` holds what its stream has not taken yet; `wake` is set
    while it holds something (cheaper per token than an asyncio.Queue)."""

    request: GenerateRequest
    choices: dict[int, ChoiceState]  # seq_id -> choice
    outbox: list[StreamItem] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    unfinished: int = 0  # choices not finished yet
    completion_tokens: int = 0
    cached_prompt_tokens: int = -1  # prefix-cache hits of the first prefill; -1 until known
    done: bool = False
    pending: list[ChoiceDelta] = field(default_factory=list)  # not yet queued (interval)
    pending_tokens: int = 0  # in `pending` and held by the choices
    deferred: bool = False  # an update fell due while `outbox` was not taken: its taker builds it
    arrived: float = 0.0  # time.monotonic() at submit
    arrived_wall: float = 0.0  # time.time() at submit (the core's clock for `scheduled`)
    scheduled: float = 0.0  # time.time() its first prefill chunk was planned (0: unknown)
    first_token: float = 0.0  # time.time() its first token came back
    first_update: float | None = None  # when its first update with tokens was queued
    # Prompt log probabilities asked: those received so far (entry i scores prompt token
    # i + 1), and whether the whole list went to the stream.
    prompt_scores: list[TokenLogprob] = field(default_factory=list)
    prompt_scores_sent: bool = False
    last_update: float = 0.0  # when its latest one was

    def add_prompt_scores(self, start: int, entries: Sequence[
            tuple[int, float, Sequence[tuple[int, float]]]]) -> None:
        """Prompt log probabilities from position `start` on ((token, logprob, top) each);
        once all prompt positions are in, they go to the stream, ahead of its first token.
        Positions computed again (a preempted request recomputes its prompt) are not
        repeated."""
        if self.done or self.prompt_scores_sent:
            return
        have = self.prompt_scores
        skip = len(have) - (start - 1)  # positions already held
        if skip < 0:
            return  # a gap cannot happen: the request reads no cached prefix
        have += (TokenLogprob(token, logprob, tuple(top))
                 for token, logprob, top in entries[skip:])
        if len(have) >= len(self.request.prompt_token_ids) - 1:
            self.prompt_scores_sent = True
            self.outbox.append(PromptLogprobs(tuple(have)))
            self.wake.set()

    def timing(self) -> RequestTiming:
        """Its queue, prefill and decode times, now that it ends."""
        end = time.time()
        scheduled = self.scheduled or self.arrived_wall
        first = self.first_token or end
        return RequestTiming(max(0.0, scheduled - self.arrived_wall),
                             max(0.0, first - scheduled), end - first)
