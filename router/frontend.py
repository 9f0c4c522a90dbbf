"""The router's front: requests in, text out. Runs beside the public gRPC servicer.

A request's life here: `submit` allocates its sequence ids and sends it to the engine core
(`router.core`); each step's `StepOutputs` from the core goes through the choices' stop
strings and incremental detokenization (`ChoiceState`), and the deltas queue per request,
`stream_interval` tokens at a time. A choice a stop string ended is reported back to the
core (`FinishSeqs`); a stream whose consumer went away aborts its request once. Everything
the core decides (admission, stop tokens, max_tokens, the context limit, failures) arrives
as messages; nothing here waits on a step.

An update that falls due while the stream's consumer has not taken the previous one yet (its
client reads slower than tokens come) is not built then. The tokens stay held by their
choices (undecoded, where no stop string needs their text) and the consumer builds one
update from all of them when it wakes, so a lagging stream costs one decode and one delta per
message it sends, not per token. A finish is always built at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from foundation.sampling_params import seed_int64
from foundation.tokenizer import ModelTokenizer
from router.choice import ChoiceState
from router.core.channel import FrontEndpoint
from router.core.messages import (
    FINISH_NONE,
    FINISH_REASONS,
    SEQ_ID_FRONT_SHIFT,
    Aborted,
    AbortRequest,
    AbortResult,
    AddRequest,
    CoreMessage,
    CoreState,
    CoreStats,
    Failed,
    FinishSeqs,
    FrontGone,
    PromptLogprobEntry,
    Refused,
    ServedInfo,
    Shutdown,
    StatsRequest,
    StepOutputs,
    duplicate_request_message,
    next_logprob,
)
from router.corks import ConnectionCorks
from router.errors import DuplicateRequestError
from router.metrics import FrontMetrics
from router.outputs import (
    ChoiceDelta,
    FailureKind,
    RequestDone,
    RequestFailed,
    StreamItem,
    Usage,
    coalesce,
)
from router.request_metrics import note_end, note_update
from router.request_state import RequestState
from router.requests import GenerateRequest
from router.tool_calls.parsers import new_parser

log = logging.getLogger("stagemesh.router")

_REFUSALS = {"resource_exhausted": FailureKind.RESOURCE_EXHAUSTED,
             "invalid_argument": FailureKind.INVALID_ARGUMENT,
             "already_exists": FailureKind.ALREADY_EXISTS}


class CoreStartError(RuntimeError):
    """The engine core could not start. kind: "capacity" (a flag exceeds a stage's
    capacity) or "pipeline" (the stages did not come up)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Frontend:
    """One front of the router (front 0 in the router's process, others in front processes:
    `router.front_server`). Single event loop.

    stream_interval: tokens a request accumulates before its stream is sent an update (1 =
    every token, vLLM's default); a finish always flushes.
    """

    def __init__(self, front_id: int, endpoint: FrontEndpoint, tokenizer: ModelTokenizer,
                 stream_interval: int = 1, metrics: FrontMetrics | None = None) -> None:
        """`metrics`: where the front records its requests' latencies (None: nowhere)."""
        self.front_id = front_id
        self.metrics = metrics
        self.endpoint = endpoint
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.requests: dict[str, RequestState] = {}
        self.seq_owner: dict[int, RequestState] = {}
        self._seq_ids = itertools.count((front_id << SEQ_ID_FRONT_SHIFT) + 1)
        self.served: asyncio.Future[ServedInfo] = asyncio.get_running_loop().create_future()
        self.core_ready = False
        # The transport of each hop between stages, as the core's latest state says.
        self.hop_transports: list[str] = []
        self._stats: dict[int, asyncio.Future[CoreStats]] = {}
        self._aborts: dict[int, asyncio.Future[bool]] = {}
        self._reply_ids = itertools.count()
        # The client connections of several live streams, corked while a message's updates
        # are written (the servicer counts each stream's peer in it).
        self.corks = ConnectionCorks()

    # --- requests --------------------------------------------------------------------------

    def submit(self, req: GenerateRequest, traceparent: str = ""
               ) -> AsyncIterator[list[StreamItem]]:
        """Send `req` to the core; the stream yields its items, coalesced per wake-up.
        `traceparent`: the request's trace context when it is traced (see `AddRequest`).

        Raises DuplicateRequestError when a live request of this front has the same
        request_id. The core's refusals (among them a request_id live on another front) and
        failures arrive as the stream's last item."""
        if req.request_id in self.requests:
            raise DuplicateRequestError(duplicate_request_message(req.request_id))
        seq_ids = [next(self._seq_ids) for _ in range(req.n)]
        stop_ids = set(req.stop_token_ids)
        if not req.ignore_eos:
            stop_ids |= set(self.tokenizer.special.eos_ids)
        params = req.sampling
        if params.min_tokens:  # the last stage bans the ids that would end it early
            params = replace(params, banned_until_min=tuple(sorted(stop_ids)))
        sampling = [params] * req.n
        if params.seed is not None:  # choices of one seeded request must differ
            sampling = [replace(params, seed=seed_int64(params.seed + i)) for i in range(req.n)]
        state = RequestState(req, {
            seq: ChoiceState(i, seq, self.tokenizer.tokenizer, req.prompt_token_ids, req.stop,
                             req.include_stop_str_in_output, req.skip_special_tokens,
                             stop_token_ids=req.stop_token_ids,
                             min_tokens=req.sampling.min_tokens,
                             tool_parser=(new_parser(req.tool_format)
                                          if req.tool_format is not None else None))
            for i, seq in enumerate(seq_ids)
        }, unfinished=req.n, arrived=time.monotonic(), arrived_wall=time.time())
        self.requests[req.request_id] = state
        for seq in seq_ids:
            self.seq_owner[seq] = state
        self.endpoint.send(AddRequest(req.request_id, seq_ids, list(req.prompt_token_ids),
                                      sampling, req.priority, req.max_tokens,
                                      sorted(stop_ids), traceparent))
        return self._stream(state)

    async def _stream(self, state: RequestState) -> AsyncIterator[list[StreamItem]]:
        """Yields every item queued since the last yield, coalesced (see `coalesce`)."""
        try:
            while True:
                await state.wake.wait()
                if state.deferred:  # updates fell due while the last one waited here
                    self._flush(state)
                state.wake.clear()
                items, state.outbox = state.outbox, []
                yield coalesce(items) if len(items) > 1 else items
                if isinstance(items[-1], RequestDone | RequestFailed):
                    return
        finally:
            if not state.done:  # the consumer went away (cancel, deadline, disconnect)
                self.abort(state.request.request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a request in any state; the core frees its blocks once. False if not live."""
        state = self.requests.get(request_id)
        if state is None or state.done:
            return False
        live = [seq for seq, choice in state.choices.items() if not choice.finished]
        for seq in live:
            state.choices[seq].abort()
        if live:
            self.endpoint.send(FinishSeqs(live, "abort"))
        self._close(state, None)
        return True

    async def abort_anywhere(self, request_id: str, timeout_s: float = 5.0) -> bool:
        """Abort a live request by id, on this front or another (the public Abort RPC): its
        stream ends with finish reason abort and its usage. False if no such request is
        live."""
        reply_id = next(self._reply_ids)
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._aborts[reply_id] = future
        self.endpoint.send(AbortRequest(self.front_id, reply_id, request_id))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._aborts.pop(reply_id, None)

    def fail_all(self, kind: FailureKind, message: str) -> None:
        """End every live request with `message` (the router is stopping)."""
        for state in list(self.requests.values()):
            self._fail(state, kind, message)

    # --- from the core ---------------------------------------------------------------------

    async def run(self) -> None:
        """Apply the core's messages until cancelled."""
        while True:
            self.handle(await self.endpoint.receive())

    def handle(self, msg: CoreMessage) -> None:
        if isinstance(msg, StepOutputs):
            self.corks.cork()  # the updates due go out together (see `router.corks`)
            try:
                self._on_outputs(msg)
            finally:
                self.corks.burst_written()
            if self.metrics is not None:
                self.metrics.publish_itls_due()
        elif isinstance(msg, Refused):
            self._fail_seqs(msg.seq_ids, _REFUSALS.get(msg.status, FailureKind.INTERNAL),
                            msg.message)
        elif isinstance(msg, Failed):
            self._fail_seqs(msg.seq_ids, FailureKind.UNAVAILABLE, msg.message)
        elif isinstance(msg, CoreState):
            self._on_state(msg)
        elif isinstance(msg, CoreStats):
            future = self._stats.pop(msg.request_id, None)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, Aborted):
            self._on_aborted(msg.seq_ids)
        elif isinstance(msg, AbortResult):
            found = self._aborts.pop(msg.reply_id, None)
            if found is not None and not found.done():
                found.set_result(msg.found)

    def _on_state(self, msg: CoreState) -> None:
        self.core_ready = msg.ready
        self.hop_transports = msg.hop_transports
        if self.served.done():
            return
        if msg.served is not None:
            self.served.set_result(msg.served)
        elif msg.error:
            self.served.set_exception(CoreStartError(msg.kind, msg.error))

    def _on_outputs(self, msg: StepOutputs) -> None:
        seq_ids, token_ids, finish = msg.unpack()
        for seq_id, cached, planned in msg.cached:
            state = self.seq_owner.get(seq_id)
            if state is not None and state.cached_prompt_tokens < 0:
                state.cached_prompt_tokens = cached
                state.scheduled = planned
        if msg.prompt_logprobs:
            self._on_prompt_logprobs(msg.prompt_logprobs)
        logprobs = msg.logprob_queues() if msg.logprobs else None
        stopped: list[int] = []
        owner, interval = self.seq_owner.get, self.stream_interval
        for seq_id, token, code in zip(seq_ids, token_ids, finish, strict=True):
            state = owner(seq_id)
            if state is None or state.done:
                continue
            choice = state.choices[seq_id]
            if choice.finish_reason is not None:
                continue
            state.completion_tokens += 1
            if not state.first_token:
                state.first_token = time.time()
            if not code and choice.holds and logprobs is None:  # the usual token (the hot
                choice.held.append(token)  # path): held, as `on_token` would, for a decode
                delta = None  # with the next update's tokens
            else:
                lp = next_logprob(logprobs, seq_id, token) if logprobs else None
                delta = choice.on_token(token, lp, FINISH_REASONS.get(code) if code else None)
            if delta is None:  # held, to be decoded with the next update's tokens
                state.pending_tokens += 1
                if state.pending_tokens >= interval:
                    self._flush_or_defer(state)
                continue
            if delta.finish_reason is not None:
                state.unfinished -= 1
                if code == FINISH_NONE:  # a stop string: tell the core
                    stopped.append(seq_id)
            self._emit(state, delta)
        if stopped:
            self.endpoint.send(FinishSeqs(stopped, "stop"))

    def _on_prompt_logprobs(self, entries: list[PromptLogprobEntry]) -> None:
        """Each request's prompt log probabilities, to its state (`add_prompt_scores`)."""
        for entry in entries:
            state = self.seq_owner.get(entry.seq_id)
            if state is not None:
                state.add_prompt_scores(entry.start, entry.entries)

    def _emit(self, state: RequestState, delta: ChoiceDelta) -> None:
        if delta.text or delta.token_ids or delta.finish_reason is not None:
            state.pending.append(delta)
            state.pending_tokens += len(delta.token_ids)
        done = state.unfinished == 0
        if done or delta.finish_reason is not None:
            self._flush(state)
        elif state.pending_tokens >= self.stream_interval:
            self._flush_or_defer(state)
        if done:
            usage = Usage(len(state.request.prompt_token_ids), state.completion_tokens,
                          max(0, state.cached_prompt_tokens))
            self._close(state, RequestDone(usage, state.timing()))

    def _flush_or_defer(self, state: RequestState) -> None:
        """An update is due: build it now if the stream has taken the last one, else leave
        it to the stream's consumer (see the module's docstring)."""
        if state.outbox:  # not taken yet: the consumer is awake or about to be
            state.deferred = True
        else:
            self._flush(state)

    def _flush(self, state: RequestState) -> None:
        """Queue everything the request accumulated (pending deltas, then the tokens its
        choices hold, decoded now) as its stream's next update."""
        state.deferred = False
        for choice in state.choices.values():
            if choice.holds and (held := choice.take_held()) is not None:
                state.pending.append(held)
        if state.pending:
            if self.metrics is not None and state.pending_tokens:  # the update has tokens
                note_update(self.metrics, state)
            state.outbox += coalesce(state.pending) if len(state.pending) > 1 else state.pending
            state.wake.set()
            state.pending = []
        state.pending_tokens = 0

    def _on_aborted(self, seq_ids: list[int]) -> None:
        """The core aborted these sequences (an Abort call): each choice ends with finish
        reason abort; the request's stream ends with its usage once none is left."""
        for seq_id in seq_ids:
            state = self.seq_owner.get(seq_id)
            if state is None or state.done or state.choices[seq_id].finished:
                continue
            choice = state.choices[seq_id]
            if choice.holds and (held := choice.take_held()) is not None:
                state.pending.append(held)
            state.unfinished -= 1
            self._emit(state, choice.abort())

    def _fail_seqs(self, seq_ids: list[int], kind: FailureKind, message: str) -> None:
        states = {id(s): s for s in (self.seq_owner.get(q) for q in seq_ids) if s is not None}
        for state in states.values():
            self._fail(state, kind, message)

    def _fail(self, state: RequestState, kind: FailureKind, message: str) -> None:
        if state.done:
            return
        if state.deferred:  # the tokens that came before the failure still go out
            self._flush(state)
        live = [seq for seq, choice in state.choices.items() if not choice.finished]
        for seq in live:
            state.choices[seq].abort()
        if live:  # the core forgets them (a no-op for those it already dropped)
            self.endpoint.send(FinishSeqs(live, "abort"))
        self._close(state, RequestFailed(kind, message))

    def _close(self, state: RequestState, last: StreamItem | None) -> None:
        if self.metrics is not None:
            note_end(self.metrics, state, last)
        state.done = True
        if last is not None:
            state.outbox.append(last)
            state.wake.set()
        self.requests.pop(state.request.request_id, None)
        for seq in state.choices:
            self.seq_owner.pop(seq, None)

    # --- to the core -----------------------------------------------------------------------

    async def stats(self, timeout_s: float = 5.0) -> CoreStats:
        """The core's counters and every stage's live usage, within `timeout_s`: the core
        gives each stage's Describe at most 2 s and at most 80 % of it (a stage that does not
        answer in time is reported not ready)."""
        request_id = next(self._reply_ids)
        future: asyncio.Future[CoreStats] = asyncio.get_running_loop().create_future()
        self._stats[request_id] = future
        self.endpoint.send(StatsRequest(self.front_id, request_id,
                                        max(0.05, min(2.0, 0.8 * timeout_s))))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._stats.pop(request_id, None)

    def shutdown_core(self) -> None:
        """Tell the core to drain the stages and exit."""
        self.endpoint.send(Shutdown())

    def report_front_gone(self, front: int) -> None:
        """Tell the core that front `front`'s process ended (the router supervises them):
        it aborts that front's sequences."""
        self.endpoint.send(FrontGone(front))

