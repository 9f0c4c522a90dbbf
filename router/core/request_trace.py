"""The engine core's share of a traced request's trace (`foundation.tracing`).

A request the front traces arrives with the W3C `traceparent` of its router span. The core
then records one span under it, "engine core", from the request's arrival at the core to
its end there: the queue (arrival to the planning of its first prefill chunk), the prefill
(that planning to the first token's return at the core), how many of its steps were
sampled for tracing, how it ended. It
also names the steps the stages record as spans of the trace (`StepTraces`): the step of
its first prefill chunk, and every `interval`-th step that computes one of its sequences.
Nothing here runs for a request that is not traced, and nothing at all while no traced
request is live.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from foundation.tracing import context_from_headers, tracer
from router.scheduler import StepPlan


class RequestTrace:
    """One traced request, as the core saw it (times from `time.time_ns()`)."""

    __slots__ = ("added_ns", "cached_tokens", "first_step", "first_token_ns", "output_tokens",
                 "sampled_steps", "scheduled_ns", "traceparent")

    def __init__(self, traceparent: str) -> None:
        self.traceparent = traceparent
        self.added_ns = time.time_ns()
        self.scheduled_ns = 0  # its first prefill chunk planned (0: still queued)
        self.first_token_ns = 0
        self.first_step = -1
        self.cached_tokens = 0
        self.sampled_steps = 0
        self.output_tokens = 0  # of its ended sequences

    def scheduled(self, step_id: int, cached_tokens: int) -> None:
        self.scheduled_ns = time.time_ns()
        self.first_step = step_id
        self.cached_tokens = cached_tokens

    def first_token(self) -> None:
        if not self.first_token_ns:
            self.first_token_ns = time.time_ns()

    def end(self, aborted: bool) -> None:
        """Record the span (the request ended at the core: finished, aborted or failed)."""
        t = tracer()
        if t is None:
            return
        end = time.time_ns()
        attributes: dict[str, str | int | float] = {
            "stagemesh.request.output_tokens": self.output_tokens,
            "stagemesh.request.aborted": aborted,
            "stagemesh.request.sampled_steps": self.sampled_steps}
        span = t.start_span("engine core", context_from_headers(
            {"traceparent": self.traceparent}), start_time=self.added_ns)
        if self.scheduled_ns:
            attributes["stagemesh.request.queue_ms"] = (self.scheduled_ns - self.added_ns) / 1e6
            attributes["stagemesh.request.first_step"] = self.first_step
            attributes["stagemesh.request.cached_tokens"] = self.cached_tokens
            span.add_event("scheduled", {"stagemesh.step.id": self.first_step},
                           timestamp=self.scheduled_ns)
        if self.first_token_ns:
            attributes["stagemesh.request.prefill_ms"] = \
                (self.first_token_ns - self.scheduled_ns) / 1e6
            span.add_event("first_token", timestamp=self.first_token_ns)
        span.set_attributes(attributes)
        span.end(end_time=end)


class _Rules(Protocol):
    """What `StepTraces` reads of a live sequence (`ledger.SeqRules`)."""

    @property
    def trace(self) -> RequestTrace | None: ...


class StepTraces:
    """Which steps the stages record as spans, and under which request's trace.

    interval: every interval-th step (by step id) that computes a sequence of a traced
    request is traced too, under the first such request found (0: first chunks only).
    """

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def of(self, plans: Sequence[StepPlan], rules: Mapping[int, _Rules]
           ) -> dict[int, str] | None:
        """Step id -> traceparent for the steps of `plans` to trace; None when none is.
        Call only while a traced request is live (`Ledger.traced`)."""
        traces: dict[int, str] = {}
        for plan in plans:
            for seq in plan.new_seqs:
                r = rules.get(seq.seq_id)
                trace = None if r is None else r.trace
                if trace is not None and not trace.scheduled_ns:
                    trace.scheduled(plan.step_id, seq.num_computed_tokens)
                    traces.setdefault(plan.step_id, trace.traceparent)
            if self.interval and plan.step_id % self.interval == 0 \
                    and plan.step_id not in traces:
                for cached in plan.cached_seqs:
                    r = rules.get(cached.seq_id)
                    trace = None if r is None else r.trace
                    if trace is not None:
                        trace.sampled_steps += 1
                        traces[plan.step_id] = trace.traceparent
                        break
        return traces or None
