"""The engine core: the scheduler, KV accounting and the pipeline driver, and nothing else.

It runs in its own process (`router.core.process`), so the fronts' per-token work
(detokenization, stop strings, streaming to clients) never delays a step. Its loop plans a
step whenever the pipeline has room and answers each step's outcome with one `StepOutputs`
per front. It applies the token-level rules itself (stop token ids and EOS, max_tokens, the
context limit), so it never plans a token past them; stop strings are a front's, reported
back with `FinishSeqs`, and tokens sampled after a finish the core learned late are
discarded by the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from foundation.model_config import ModelConfig
from router.core.capacity import plan_capacity
from router.core.config import CoreConfig
from router.core.ledger import Ledger
from router.core.messages import (
    FINISH_NONE,
    FINISH_STOP,
    Aborted,
    AbortRequest,
    AbortResult,
    AddRequest,
    CoreMessage,
    CoreState,
    Failed,
    FinishSeqs,
    FrontGone,
    FrontMessage,
    FrontOutbox,
    Hello,
    LogprobEntry,
    PromptLogprobEntry,
    Refused,
    ServedInfo,
    Shutdown,
    StatsRequest,
    duplicate_request_message,
    front_of,
)
from router.core.pace import RunAheadPace
from router.core.recovery import Outage
from router.core.request_trace import StepTraces
from router.core.stats import core_stats, stage_stats
from router.metrics import CoreMetrics
from router.pipeline import Pipeline, PipelineShape, PipelineState, StepOutcome
from router.scheduler import (
    AdmissionRefusedError,
    ChoiceSpec,
    FinishReason,
    Scheduler,
    SchedulerError,
    StepPlan,
)

log = logging.getLogger("stagemesh.core")
SETTLE_S = 2.0  # after Shutdown, how long the stages get to answer and learn every finish


class OutputSink(Protocol):
    """Where the core's messages go (`CoreEndpoint`, or a list in tests)."""

    def send(self, front: int, msg: CoreMessage) -> None: ...

    def broadcast(self, msg: CoreMessage) -> None: ...

    def forget(self, front: int) -> None: ...


class EngineCore:
    """Owns the scheduler and the pipeline; one per router, serving every front of it (each
    says `Hello`; `FrontGone` ends one). Single event loop."""

    def __init__(self, cfg: CoreConfig, model: ModelConfig, pipeline: Pipeline,
                 sink: OutputSink, metrics: CoreMetrics | None = None) -> None:
        """`metrics`: where the core records its metrics (None: it records none)."""
        self.cfg = cfg
        self.metrics = metrics
        self.model = model
        self.pipeline = pipeline
        self.sink = sink
        pipeline.on_outcome = self._on_outcome
        pipeline.on_answered = self._on_answered
        pipeline.on_failure = self._on_failure
        self.scheduler: Scheduler | None = None
        self.pace: RunAheadPace | None = None  # built with the scheduler
        self.served: ServedInfo | None = None
        self.ledger = Ledger()
        self._step_traces = StepTraces(cfg.trace_step_interval)
        self.fronts: set[int] = set()  # said hello, not gone
        self._gone_fronts: set[int] = set()
        self.steps = 0
        self._wake = asyncio.Event()
        self.stopped = asyncio.Event()  # a front said Shutdown
        self._sent_at: dict[int, float] = {}
        self.outbox = FrontOutbox()  # sent once a message's answers are all handled
        self.outage = Outage(pipeline, cfg.recovery_budget_s, metrics)
        self._was_ready = False
        self.start_error: CoreState | None = None  # set when start() failed

    # --- lifetime --------------------------------------------------------------------------

    async def start(self) -> ServedInfo:
        """Bring the pipeline up within the startup budget and build the scheduler.

        Raises PipelineError or CapacityError (`process.run_core` tells the fronts)."""
        shape = await self.pipeline.start(self.cfg.startup_budget_s)
        self.scheduler, self.served = self._build(shape)
        return self.served

    def _build(self, shape: PipelineShape) -> tuple[Scheduler, ServedInfo]:
        capacity = plan_capacity(self.cfg, self.model, shape)
        served = ServedInfo(capacity.limits, shape.dtype, shape.tp_size, shape.num_stages,
                            shape.block_size, capacity.scheduler.max_inflight_steps)
        scheduler = Scheduler(capacity.scheduler, capacity.kv)
        self.pace = RunAheadPace(scheduler, self.cfg.run_ahead_depth,
                                 self.cfg.run_ahead_budget_ms / 1e3)
        return scheduler, served

    async def serve(self) -> None:
        """Step until a front says Shutdown (or the task is cancelled). A bug that ends the
        step loop or the watchdog is raised here, never left as a silent stall."""
        self._publish_state()
        tasks = [asyncio.create_task(self._step_loop(), name="core-steps"),
                 asyncio.create_task(self._watch_steps(), name="core-step-watchdog")]
        stopped = asyncio.create_task(self.stopped.wait())
        try:
            await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                if task.done():
                    task.result()  # raises what ended it
            await self._settle()
        finally:
            stopped.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, stopped, return_exceptions=True)

    async def _settle(self) -> None:
        """After Shutdown (the fronts have drained): step on until the steps still out are
        answered and the stages told of every sequence that ended (a stop string reported
        just before Shutdown, say), so each stage stops holding nothing; SETTLE_S at most.
        A sequence still live has no client left: it is aborted."""
        deadline = time.monotonic() + SETTLE_S
        self._abort_live()
        while (self.ready and self.scheduler is not None and not self.scheduler.settled
               and time.monotonic() < deadline):
            self._wake.set()
            await asyncio.sleep(0.005)

    def handle(self, msg: FrontMessage) -> None:
        """Apply one front message (the receive loop calls it for each)."""
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, FinishSeqs):
            self._finish(msg)
        elif isinstance(msg, Hello):
            self._hello(msg)
        elif isinstance(msg, StatsRequest):
            asyncio.create_task(self._stats(msg))  # noqa: RUF006 (answers on its own)
        elif isinstance(msg, AbortRequest):
            self._abort_request(msg)
        elif isinstance(msg, FrontGone):
            self._drop_front(msg.front)
        elif isinstance(msg, Shutdown):
            self.stopped.set()
        self._wake.set()

    @property
    def ready(self) -> bool:
        return self.scheduler is not None and self.pipeline.state is PipelineState.READY

    def _state(self) -> CoreState:
        return self.start_error or CoreState(self.ready, self.served,
                                             hop_transports=list(self.pipeline.hop_transports))

    def _publish_state(self) -> None:
        if self.ready != self._was_ready:
            self._was_ready = self.ready
            self.sink.broadcast(self._state())

    # --- fronts ----------------------------------------------------------------------------

    def _hello(self, msg: Hello) -> None:
        """A front (new, or one that restarted its endpoint) gets the state at once: a front
        that joins a core already serving learns the served model from this reply."""
        self.fronts.add(msg.front)
        log.info("front %d connected (%d front(s))", msg.front, len(self.fronts))
        self.sink.send(msg.front, self._state())

    def _drop_front(self, front: int) -> None:
        """A front process died: abort its sequences (the next plan tells the stages) and
        send it nothing more."""
        self._gone_fronts.add(front)
        self.fronts.discard(front)
        self.sink.forget(front)
        self.outbox.forget(front)
        seq_ids = self._abort_live(front)
        log.log(logging.WARNING if seq_ids else logging.INFO,
                "front %d is gone: %d of its sequence(s) aborted", front, len(seq_ids))

    # --- requests --------------------------------------------------------------------------

    def _add(self, msg: AddRequest) -> None:
        scheduler = self.scheduler
        front = front_of(msg.seq_ids[0])
        if front in self._gone_fronts:  # sent just before that front died
            return
        if scheduler is None or self.outage.past_budget:
            self.sink.send(front, Failed(msg.seq_ids, (
                f"the pipeline is down past its recovery budget: {self.outage.reason}"
                if scheduler else "starting")))
            return
        if self.ledger.is_live(msg.request_id):  # request ids are unique across fronts
            self.sink.send(front, Refused(msg.seq_ids, "already_exists",
                                          duplicate_request_message(msg.request_id)))
            return
        choices = [ChoiceSpec(s, p) for s, p in zip(msg.seq_ids[1:], msg.sampling[1:],
                                                     strict=True)]
        try:
            scheduler.add_request(msg.seq_ids[0], msg.prompt, msg.sampling[0],
                                  priority=msg.priority, extra_choices=choices,
                                  read_prefix_cache=msg.sampling[0].prompt_logprobs is None)
        except AdmissionRefusedError as e:
            self.sink.send(front, Refused(msg.seq_ids, "resource_exhausted", str(e)))
            return
        except SchedulerError as e:
            self.sink.send(front, Refused(msg.seq_ids, "invalid_argument", str(e)))
            return
        self.ledger.add(msg.request_id, msg.seq_ids, msg.max_tokens,
                        frozenset(msg.stop_token_ids),
                        [params.logprobs is not None for params in msg.sampling],
                        msg.traceparent)

    def _finish(self, msg: FinishSeqs) -> None:
        reason = FinishReason(msg.reason)
        aborted = reason is FinishReason.ABORT
        for seq_id in msg.seq_ids:
            if self.ledger.end(seq_id, aborted) is not None and self.scheduler is not None:
                self.scheduler.finish(seq_id, reason)

    def _abort_live(self, front: int | None = None) -> list[int]:
        """Abort every live sequence (of `front`, or of all fronts) in the ledger and the
        scheduler (the next plan tells the stages); returns their ids."""
        seq_ids = self.ledger.abort_all(front)
        if self.scheduler is not None:
            for seq_id in seq_ids:
                self.scheduler.abort(seq_id)
        return seq_ids

    def _abort_request(self, msg: AbortRequest) -> None:
        """The public Abort: end a request's sequences wherever it runs; its front ends the
        stream, the asking front answers the caller."""
        seq_ids = self.ledger.live_seqs(msg.request_id)
        for seq_id in seq_ids:
            self.ledger.end(seq_id, aborted=True)
            if self.scheduler is not None:
                self.scheduler.abort(seq_id)
        if seq_ids and front_of(seq_ids[0]) not in self._gone_fronts:
            self.sink.send(front_of(seq_ids[0]), Aborted(seq_ids))
        self.sink.send(msg.front, AbortResult(msg.reply_id, bool(seq_ids)))

    # --- the step loop ---------------------------------------------------------------------

    async def _step_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.pipeline.state is PipelineState.DOWN:
                await self._recover()
                continue
            scheduler, pace = self.scheduler, self.pace
            assert scheduler is not None and pace is not None
            while self.pipeline.state is PipelineState.READY and pace.room():
                plans = []
                while (plan := scheduler.schedule()) is not None:
                    self._sent_at[plan.step_id] = time.monotonic()
                    self._note_prefix_hits(plan)
                    plans.append(plan)
                if not plans:
                    break
                self.steps += len(plans)
                await self.pipeline.send(plans, self._step_traces.of(plans, self.ledger.rules)
                                         if self.ledger.traced else None,
                                         pace.holds(len(plans)))

    def _note_prefix_hits(self, plan: StepPlan) -> None:
        """A sequence's first prefill starts at its prefix-cache hits, now (its queue time
        ends); reported once."""
        for seq in plan.new_seqs:
            rules = self.ledger.rules.get(seq.seq_id)
            if rules is not None and not rules.reported_cached:
                rules.reported_cached = True
                self.outbox.note_cached(front_of(seq.seq_id),
                                        (seq.seq_id, seq.num_computed_tokens, time.time()))

    def _on_outcome(self, outcome: StepOutcome) -> None:
        sent, now = self._sent_at.pop(outcome.step_id, None), time.monotonic()
        if self.metrics is not None and sent is not None:
            self.metrics.observe_step(now - sent, idle=not self._sent_at)
        scheduler, outbox, live = self.scheduler, self.outbox, self.ledger.rules
        assert scheduler is not None
        update = scheduler.update(outcome.step_id, outcome.tokens)
        capped = set(update.length_capped_seq_ids)
        for scores in outcome.prompt:
            if scores.seq_id in live:
                outbox.batch(front_of(scores.seq_id)).prompt_logprobs.append(
                    PromptLogprobEntry(scores.seq_id, scores.start, [
                        (e.token_id, e.logprob, list(e.top)) for e in scores.entries]))
        seq_ids, tokens = list(update.new_tokens), list(update.new_tokens.values())
        codes, wants = self.ledger.settle(seq_ids, tokens, capped)
        outbox.add_tokens(seq_ids, tokens, codes)
        if codes.count(FINISH_NONE) != len(codes):  # ended (a capped one already was)
            for seq_id, code in zip(seq_ids, codes, strict=True):
                if code > FINISH_NONE and seq_id not in capped:
                    scheduler.finish(seq_id, FinishReason.STOP if code == FINISH_STOP
                                     else FinishReason.LENGTH)
        for seq_id in wants:
            if (lp := outcome.logprobs.get(seq_id)) is not None:
                outbox.batch(front_of(seq_id)).logprobs.append(
                    LogprobEntry(seq_id, lp.token_id, lp.logprob, list(lp.top)))
        self._wake.set()

    def _on_answered(self, count: int) -> None:
        """A message of `count` answers was handled: the pace; the tokens to the fronts."""
        assert self.pace is not None
        self.pace.answered(time.monotonic(), bool(self._sent_at), count)
        self._send_outbox()

    def _send_outbox(self) -> None:
        for front, msg in self.outbox.take():
            self.sink.send(front, msg)

    async def _watch_steps(self) -> None:
        """A step with no result past `step_timeout_s` marks the pipeline down (a hung
        stage is detected, never waited on for ever). Steps are answered in order, so
        only the oldest outstanding one needs watching."""
        period = min(1.0, self.cfg.step_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            self._publish_state()
            if self.metrics is not None and self.scheduler is not None:
                self.metrics.refresh(self.scheduler.stats(), self.steps)
                self.metrics.publish_steps()
            if not self._sent_at or self.pipeline.state is not PipelineState.READY:
                continue
            oldest = min(self._sent_at)
            if time.monotonic() - self._sent_at[oldest] > self.cfg.step_timeout_s:
                self.pipeline.mark_down(f"step {oldest} got no result within "
                                        f"{self.cfg.step_timeout_s:.0f}s")

    # --- failures --------------------------------------------------------------------------

    def _on_failure(self, reason: str) -> None:
        """A stage failed: keep every request (the core has its tokens), preempt all
        sequences for recompute, and re-link when the stages are back (`Outage`)."""
        self._send_outbox()  # the tokens of steps answered before it
        self.outage.begin(reason)
        self._sent_at.clear()
        assert self.scheduler is not None and self.pace is not None
        self.pace.reset()  # the re-linked pipeline's pace is measured afresh
        preempted = self.scheduler.preempt_all()
        log.warning("pipeline failure (%s): %d sequence(s) preempted for recompute", reason,
                    preempted)
        self._publish_state()
        self._wake.set()

    async def _recover(self) -> None:
        if not await self.outage.recover():
            self._fail_all("pipeline stage unavailable past the recovery budget: "
                           f"{self.outage.reason}")
            await asyncio.sleep(1.0)
            self._wake.set()  # keep trying in the background; readiness stays NOT_SERVING
            return
        self._publish_state()
        self._wake.set()

    def _fail_all(self, message: str) -> None:
        log.error("%s; failing %d sequence(s)", message, len(self.ledger))
        by_front: dict[int, list[int]] = {}
        for seq_id in self._abort_live():
            by_front.setdefault(front_of(seq_id), []).append(seq_id)
        for front, seq_ids in by_front.items():
            self.sink.send(front, Failed(seq_ids, message))

    # --- stats -----------------------------------------------------------------------------

    async def _stats(self, msg: StatsRequest) -> None:
        assert self.scheduler is not None
        stages = await stage_stats(self.pipeline, self.ready, msg.stage_timeout_s)
        self.sink.send(msg.front, core_stats(msg, self.scheduler.stats(), stages, self.steps,
                                             self.ledger, self.fronts))
