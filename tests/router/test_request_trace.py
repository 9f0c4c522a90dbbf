"""The engine core's share of a traced request (`router.core.request_trace`): which steps
the stages record as spans, and the core's own span of the request, exported through the
OpenTelemetry SDK's in-memory exporter."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import foundation.tracing
from router.core.ledger import Ledger
from router.core.messages import FINISH_LENGTH, FINISH_NONE
from router.core.request_trace import StepTraces
from router.scheduler import StepPlan
from router.scheduler.plan import CachedSeq, NewSeq


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(foundation.tracing, "_tracer", provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


def _traceparent() -> tuple[int, int, str]:
    trace_id, span_id = secrets.token_bytes(16), secrets.token_bytes(8)
    return (int.from_bytes(trace_id), int.from_bytes(span_id),
            f"00-{trace_id.hex()}-{span_id.hex()}-01")


def _new(seq_id: int, computed: int = 0) -> NewSeq:
    return NewSeq(seq_id, (1, 2, 3, 4), 4, None, (0,), computed, 4 - computed, True)


def _cached(seq_id: int) -> CachedSeq:
    return CachedSeq(seq_id, (), 4, 1, (5,), None, True)


def test_first_chunks_and_every_interval_th_step_of_a_traced_sequence() -> None:
    ledger = Ledger()
    _, _, parent = _traceparent()
    ledger.add("traced", [10], 8, frozenset(), [False], parent)
    ledger.add("plain", [11], 8, frozenset(), [False])
    assert ledger.traced == 1
    traces = StepTraces(interval=4)
    plans = [StepPlan(7, (_new(11), _new(10, computed=2)), ()),
             StepPlan(8, (), (_cached(11),)),  # a multiple of 4, the traced one absent
             StepPlan(9, (), (_cached(11), _cached(10))),
             StepPlan(12, (), (_cached(11), _cached(10)))]
    assert traces.of(plans, ledger.rules) == {7: parent, 12: parent}
    trace = ledger.rules[10].trace
    assert trace is not None and trace.first_step == 7 and trace.cached_tokens == 2
    assert trace.sampled_steps == 1
    # A later chunk of the same request is not its first: only the interval counts.
    assert traces.of([StepPlan(13, (_new(10),), ())], ledger.rules) is None
    assert StepTraces(interval=0).of([StepPlan(16, (), (_cached(10),))], ledger.rules) is None


def test_the_core_records_one_span_per_traced_request(exported: InMemorySpanExporter) -> None:
    ledger = Ledger()
    trace_id, span_id, parent = _traceparent()
    ledger.add("r", [3, 4], 2, frozenset(), [False, False], parent)
    StepTraces(64).of([StepPlan(64, (_new(3), _new(4)), ())], ledger.rules)
    assert ledger.settle([3, 4], [9, 9], set()) == ([FINISH_NONE, FINISH_NONE], [])
    assert exported.get_finished_spans() == ()  # open while a sequence lives
    assert ledger.settle([3], [9], set()) == ([FINISH_LENGTH], [])
    ledger.end(4, aborted=True)
    (span,) = exported.get_finished_spans()
    assert ledger.traced == 0
    assert span.name == "engine core"
    assert span.context.trace_id == trace_id and span.parent.span_id == span_id
    assert [e.name for e in span.events] == ["scheduled", "first_token"]
    attrs = span.attributes
    assert attrs["stagemesh.request.first_step"] == 64
    assert attrs["stagemesh.request.aborted"] is True  # one choice was aborted
    assert attrs["stagemesh.request.output_tokens"] == 3  # both sequences'
    assert attrs["stagemesh.request.queue_ms"] >= 0
    assert attrs["stagemesh.request.prefill_ms"] >= 0
    assert span.start_time <= span.events[0].timestamp <= span.events[1].timestamp \
        <= span.end_time


def test_a_request_that_never_ran_has_no_queue_time(exported: InMemorySpanExporter) -> None:
    ledger = Ledger()
    ledger.add("r", [1], 4, frozenset(), [False], _traceparent()[2])
    ledger.abort_all()
    (span,) = exported.get_finished_spans()
    assert "stagemesh.request.queue_ms" not in span.attributes and not span.events


def test_untraced_requests_cost_no_trace() -> None:
    ledger = Ledger()
    ledger.add("r", [1], 4, frozenset(), [False])
    assert ledger.traced == 0 and ledger.rules[1].trace is None
