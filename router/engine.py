"""The router's engine: requests in, scheduler steps down the pipeline, deltas out.

All state lives on one asyncio loop. A request's life: `submit` admits it into the scheduler
and returns a stream; the step loop plans steps while the pipeline has room and sends them;
each last-stage result goes through `Scheduler.update`, then every new token through its
choice's stop rules; finished choices are reported back with `Scheduler.finish`. Aborts free
blocks at once; the next plan tells the stages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

from foundation.tokenizer import ModelTokenizer
from router.choice import ChoiceState
from router.errors import DuplicateRequestError, UnavailableError
from router.outputs import (
    ChoiceDelta,
    FailureKind,
    RequestDone,
    RequestFailed,
    StreamItem,
    Usage,
    coalesce,
)
from router.pipeline import Pipeline, PipelineShape, PipelineState, StepOutcome
from router.requests import GenerateRequest
from router.scheduler import ChoiceSpec, NewSeq, Scheduler

log = logging.getLogger("stagemesh.router")


@dataclass(frozen=True)
class EngineConfig:
    """stream_interval: tokens a request accumulates before its stream is sent an update
    (1 = every token, as vLLM's default; larger values cut per-token streaming cost at high
    concurrency). A finish always flushes."""

    step_timeout_s: float = 30.0
    recovery_budget_s: float = 60.0
    stream_interval: int = 1


@dataclass
class RequestState:
    request: GenerateRequest
    choices: dict[int, ChoiceState]  # seq_id -> choice
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    completion_tokens: int = 0
    cached_prompt_tokens: int = -1  # prefix-cache hits of the first prefill; -1 until known
    done: bool = False
    pending: list[ChoiceDelta] = field(default_factory=list)  # not yet queued (interval)
    pending_tokens: int = 0


class Engine:
    """Owns the scheduler and the pipeline; one instance per router."""

    def __init__(self, cfg: EngineConfig, make_scheduler: Callable[[PipelineShape], Scheduler],
                 pipeline: Pipeline, tokenizer: ModelTokenizer) -> None:
        """`make_scheduler` builds the scheduler once the stages reported their capacity."""
        self.cfg = cfg
        self._make_scheduler = make_scheduler
        self._scheduler: Scheduler | None = None
        self.pipeline = pipeline
        pipeline.on_outcome = self._on_outcome
        pipeline.on_failure = self._on_failure
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.seq_owner: dict[int, RequestState] = {}
        self._seq_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._sent_at: dict[int, float] = {}
        self._down_since: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self.steps = 0
        self.requests_finished = 0

    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise RuntimeError("the pipeline is still starting")
        return self._scheduler

    @property
    def ready(self) -> bool:
        return self._scheduler is not None and self.pipeline.state is PipelineState.READY

    # --- requests -----------------------------------------------------------------------

    def submit(self, req: GenerateRequest) -> AsyncIterator[list[StreamItem]]:
        """Admit `req`.

        Raises:
            AdmissionRefusedError, InvalidRequestError: from the scheduler.
            DuplicateRequestError: a live request has the same request_id.
            UnavailableError: the pipeline is down past its recovery budget.
        """
        if self.pipeline.state is not PipelineState.READY and self._down_since is not None \
                and time.monotonic() - self._down_since > self.cfg.recovery_budget_s:
            raise UnavailableError("the pipeline is down past its recovery budget")
        if req.request_id in self.requests:
            raise DuplicateRequestError(f"request_id {req.request_id!r} is already running; "
                                        "request ids must be unique among live requests")
        seq_ids = [next(self._seq_ids) for _ in range(req.n)]
        sampling = [req.sampling] * req.n
        if req.sampling.seed is not None:  # choices of one seeded request must differ
            sampling = [replace(req.sampling, seed=req.sampling.seed + i) for i in range(req.n)]
        self.scheduler.add_request(
            seq_ids[0], req.prompt_token_ids, sampling[0], priority=req.priority,
            extra_choices=[ChoiceSpec(s, p) for s, p in zip(seq_ids[1:], sampling[1:],
                                                            strict=True)])
        stop_ids = set(req.stop_token_ids)
        if not req.ignore_eos:
            stop_ids |= set(self.tokenizer.special.eos_ids)
        state = RequestState(req, {
            seq: ChoiceState(i, seq, self.tokenizer.tokenizer, req.prompt_token_ids,
                             req.max_tokens, stop_ids, req.stop, req.include_stop_str_in_output,
                             req.skip_special_tokens)
            for i, seq in enumerate(seq_ids)
        })
        self.requests[req.request_id] = state
        for seq in seq_ids:
            self.seq_owner[seq] = state
        self._wake.set()
        return self._stream(state)

    async def _stream(self, state: RequestState) -> AsyncIterator[list[StreamItem]]:
        """Yields every item queued since the last yield, coalesced (see `coalesce`)."""
        try:
            while True:
                items = [await state.queue.get()]
                while not state.queue.empty():
                    items.append(state.queue.get_nowait())
                yield coalesce(items)
                if isinstance(items[-1], RequestDone | RequestFailed):
                    return
        finally:
            if not state.done:  # the consumer went away (cancel, deadline, disconnect)
                self.abort(state.request.request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a request in any state; its blocks are freed once. False if not live."""
        state = self.requests.get(request_id)
        if state is None or state.done:
            return False
        for seq, choice in state.choices.items():
            if not choice.finished:
                choice.abort()
                self.scheduler.abort(seq)
        self._close(state, None)
        self._wake.set()
        return True

    # --- the step loop ------------------------------------------------------------------

    async def start(self, budget_s: float) -> PipelineShape:
        """Bring the pipeline up (within `budget_s`), build the scheduler, start stepping."""
        shape = await self.pipeline.start(budget_s)
        self._scheduler = self._make_scheduler(shape)
        self._task = asyncio.create_task(self._loop(), name="router-step-loop")
        self._watchdog = asyncio.create_task(self._watch_steps(), name="router-step-watchdog")
        return shape

    async def stop(self) -> None:
        for task in (self._task, self._watchdog):
            if task is not None:
                task.cancel()
        for request_id in list(self.requests):
            self._fail(self.requests[request_id], FailureKind.UNAVAILABLE, "server stopping")

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.pipeline.state is PipelineState.DOWN:
                await self._recover()
                continue
            while self.pipeline.state is PipelineState.READY:
                plan = self.scheduler.schedule()
                if plan is None:
                    break
                self._sent_at[plan.step_id] = time.monotonic()
                self.steps += 1
                self._note_prefix_hits(plan.new_seqs)
                await self.pipeline.send(plan)

    async def _watch_steps(self) -> None:
        """A step with no result past `step_timeout_s` marks the pipeline down (a hung
        stage is detected, never waited on for ever). Steps are answered in order, so
        only the oldest outstanding one needs watching."""
        period = min(1.0, self.cfg.step_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            if not self._sent_at or self.pipeline.state is not PipelineState.READY:
                continue
            oldest = min(self._sent_at)
            if time.monotonic() - self._sent_at[oldest] > self.cfg.step_timeout_s:
                self.pipeline.mark_down(f"step {oldest} got no result within "
                                        f"{self.cfg.step_timeout_s:.0f}s")

    def _note_prefix_hits(self, new_seqs: Sequence[NewSeq]) -> None:
        """A request's first prefill starts at its prefix-cache hits (later ones after a
        preemption, and forks of n > 1, do not count)."""
        for seq in new_seqs:
            state = self.seq_owner.get(seq.seq_id)
            if state is not None and state.cached_prompt_tokens < 0:
                state.cached_prompt_tokens = seq.num_computed_tokens

    def _on_outcome(self, outcome: StepOutcome) -> None:
        self._sent_at.pop(outcome.step_id, None)
        logprobs = outcome.logprobs
        update = self.scheduler.update(outcome.step_id, outcome.tokens)
        capped = set(update.length_capped_seq_ids)
        for seq, token in update.new_tokens.items():
            state = self.seq_owner.get(seq)
            if state is None or state.done:
                continue
            choice = state.choices[seq]
            if choice.finished:
                continue
            want_lp = state.request.sampling.logprobs is not None
            delta = choice.on_token(token, logprobs.get(seq) if want_lp else None,
                                    seq in capped)
            state.completion_tokens += 1
            if choice.finish_reason is not None and seq not in capped:
                self.scheduler.finish(seq, choice.finish_reason)
            self._emit(state, delta)
        self._wake.set()

    def _emit(self, state: RequestState, delta: ChoiceDelta) -> None:
        if delta.text or delta.token_ids or delta.finish_reason is not None:
            state.pending.append(delta)
            state.pending_tokens += len(delta.token_ids)
        done = all(c.finished for c in state.choices.values())
        if state.pending and (done or delta.finish_reason is not None
                              or state.pending_tokens >= self.cfg.stream_interval):
            for item in coalesce(state.pending):
                state.queue.put_nowait(item)
            state.pending.clear()
            state.pending_tokens = 0
        if done:
            usage = Usage(len(state.request.prompt_token_ids), state.completion_tokens,
                          max(0, state.cached_prompt_tokens))
            self._close(state, RequestDone(usage))
            self.requests_finished += 1

    def _close(self, state: RequestState, last: StreamItem | None) -> None:
        state.done = True
        if last is not None:
            state.queue.put_nowait(last)
        self.requests.pop(state.request.request_id, None)
        for seq in state.choices:
            self.seq_owner.pop(seq, None)

    def _fail(self, state: RequestState, kind: FailureKind, message: str) -> None:
        for seq, choice in state.choices.items():
            if not choice.finished:
                choice.abort()
                self.scheduler.abort(seq)
        self._close(state, RequestFailed(kind, message))

    # --- failures -----------------------------------------------------------------------

    def _on_failure(self, reason: str) -> None:
        """A stage failed: keep every request (the router has its tokens), preempt all
        sequences for recompute, and re-link when the stages are back."""
        self._down_since = time.monotonic()
        self._sent_at.clear()
        preempted = self.scheduler.preempt_all()
        log.warning("pipeline failure (%s): %d sequence(s) preempted for recompute", reason,
                    preempted)
        self._wake.set()

    async def _recover(self) -> None:
        assert self._down_since is not None
        budget = self.cfg.recovery_budget_s - (time.monotonic() - self._down_since)
        try:
            await self.pipeline.start(max(budget, 0.0))
        except Exception as e:
            log.error("pipeline did not recover: %s; failing %d request(s)", e,
                      len(self.requests))
            for state in list(self.requests.values()):
                self._fail(state, FailureKind.UNAVAILABLE,
                           f"pipeline stage unavailable past the recovery budget: {e}")
            await asyncio.sleep(1.0)
            self._wake.set()  # keep trying in the background; readiness stays NOT_SERVING
            return
        self._down_since = None
        self._wake.set()

