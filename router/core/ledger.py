"""The engine core's record of what is live: each sequence's token-level rules (stop token
ids, max_tokens) and the request it belongs to, the request ids in use (unique across every
front, since one core serves them all) and how many requests finished, in all and by front.
Pure bookkeeping: the core tells the scheduler."""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from router.core.messages import FINISH_LENGTH, FINISH_NONE, FINISH_STOP, NOT_LIVE, front_of
from router.core.request_trace import RequestTrace


class LiveRequest:
    """A request with at least one live sequence. aborted: one of its sequences was aborted
    or failed, so it does not count as finished. trace: the core's record of it when the
    front traces it (`request_trace`), else None."""

    __slots__ = ("aborted", "live", "request_id", "seq_ids", "trace")

    def __init__(self, request_id: str, seq_ids: tuple[int, ...],
                 trace: RequestTrace | None = None) -> None:
        self.request_id = request_id
        self.seq_ids = seq_ids  # one per choice
        self.live = len(seq_ids)
        self.aborted = False
        self.trace = trace


class SeqRules:
    """The token-level rules of one live sequence, and what the core reported of it."""

    __slots__ = ("generated", "logprobs", "max_tokens", "reported_cached", "request",
                 "stop_ids")

    def __init__(self, request: LiveRequest, max_tokens: int, stop_ids: frozenset[int],
                 logprobs: bool) -> None:
        self.request = request
        self.max_tokens = max_tokens
        self.stop_ids = stop_ids
        self.logprobs = logprobs
        self.generated = 0
        self.reported_cached = False

    @property
    def trace(self) -> RequestTrace | None:
        return self.request.trace


class Ledger:
    """Live sequences by id (`rules`, read directly on the per-token path) and live requests
    by request id."""

    def __init__(self) -> None:
        self.rules: dict[int, SeqRules] = {}
        self._requests: dict[str, LiveRequest] = {}
        self.requests_finished = 0
        self.finished_by_front: dict[int, int] = {}
        self.traced = 0  # live requests with a trace

    def __len__(self) -> int:
        return len(self.rules)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request_id: str, seq_ids: list[int], max_tokens: int,
            stop_ids: frozenset[int], logprobs: list[bool], traceparent: str = "") -> None:
        """Record an admitted request: one sequence per choice; `traceparent` (its router
        span's) when the front traces it. The caller checked `is_live(request_id)` first."""
        trace = RequestTrace(traceparent) if traceparent else None
        self.traced += trace is not None
        request = LiveRequest(request_id, tuple(seq_ids), trace)
        self._requests[request_id] = request
        for seq_id, wants_logprobs in zip(seq_ids, logprobs, strict=True):
            self.rules[seq_id] = SeqRules(request, max_tokens, stop_ids, wants_logprobs)

    def live_seqs(self, request_id: str) -> list[int]:
        """The live sequences of a live request ([] if it is not live)."""
        request = self._requests.get(request_id)
        return [] if request is None else [s for s in request.seq_ids if s in self.rules]

    def end(self, seq_id: int, aborted: bool) -> SeqRules | None:
        """Forget a sequence (its request too, once its last sequence ended; it counts as
        finished unless one of them was aborted). None if it was not live."""
        rules = self.rules.pop(seq_id, None)
        if rules is None:
            return None
        request = rules.request
        request.live -= 1
        request.aborted |= aborted
        if request.trace is not None:
            request.trace.output_tokens += rules.generated
        if request.live == 0:
            del self._requests[request.request_id]
            if request.trace is not None:
                self.traced -= 1
                request.trace.end(request.aborted)
            if not request.aborted:
                self.requests_finished += 1
                front = front_of(seq_id)
                self.finished_by_front[front] = self.finished_by_front.get(front, 0) + 1
        return rules

    def settle(self, seq_ids: Sequence[int], tokens: Sequence[int],
               capped: AbstractSet[int]) -> tuple[list[int], list[int]]:
        """A step's new tokens (`tokens[i]` is `seq_ids[i]`'s) against their sequences'
        rules, in one pass (the hot loop: every token): each token's FINISH_* code, and the
        live sequences that want log probabilities. A stop token, `max_tokens` or `capped`
        (the sequences the scheduler ended at the context limit) ends its sequence here; the
        caller tells the scheduler. NOT_LIVE: the sequence is not live (its token is
        dropped)."""
        rules_of, codes, wants = self.rules.get, [], []
        for seq_id, token in zip(seq_ids, tokens, strict=True):
            rules = rules_of(seq_id)
            if rules is None:
                codes.append(NOT_LIVE)
                continue
            rules.generated += 1
            if rules.generated == 1 and rules.request.trace is not None:
                rules.request.trace.first_token()
            if token in rules.stop_ids:
                codes.append(FINISH_STOP)
            elif rules.generated >= rules.max_tokens or seq_id in capped:
                codes.append(FINISH_LENGTH)
            else:
                codes.append(FINISH_NONE)
            if rules.logprobs:
                wants.append(seq_id)
            if codes[-1]:
                self.end(seq_id, aborted=False)
        return codes, wants

    def abort_all(self, front: int | None = None) -> list[int]:
        """End every live sequence, of one front or of all, as aborted; returns their ids."""
        seq_ids = [seq_id for seq_id in self.rules if front is None or front_of(seq_id) == front]
        for seq_id in seq_ids:
            self.end(seq_id, aborted=True)
        return seq_ids
