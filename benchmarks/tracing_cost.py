"""The CPU cost of tracing one request, part by part: what the router's front does for a
traced Generate call (its span, the GenAI attributes, the context handed to the core, the
first-token event, the end), what the engine core does (`router.core.request_trace`), and
what exporting costs (OTLP encoding of the finished spans, done by the SDK's batch thread
in each of those processes). Each part is the product's own code, timed in one process
over `--requests` requests (spans go to the SDK's in-memory exporter, then through the OTLP
encoder); µs per request. Noise-free where a throughput run is not: the W3 cost of tracing
is these microseconds against the router's CPU per request.

    python -m benchmarks.tracing_cost --requests 5000
"""

from __future__ import annotations

import argparse
import datetime as dt
import secrets
import time
from pathlib import Path
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import foundation.tracing
from benchmarks.report import git_revision, print_table, write_json
from foundation.tracing import traceparent_of
from router.audit import AuditRecord
from router.client import build_request
from router.core.request_trace import RequestTrace
from router.requests import GenerateRequest, SamplingParams
from router.service import _end_generate_span, _first_token, _generate_span, _request_attributes


class _Call:
    """The gRPC call context `_generate_span` reads: the caller's metadata."""

    def __init__(self, traceparent: str) -> None:
        self._metadata = (("traceparent", traceparent),)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/tracing-cost-{dt.date.today()}.json"))
    args = ap.parse_args()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    foundation.tracing._tracer = provider.get_tracer("stagemesh")
    request = build_request("x", max_tokens=256)
    req = GenerateRequest("r", tuple(range(512)), SamplingParams(), 256, (), (), True, 1, 0)
    calls = [_Call(f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01")
             for _ in range(args.requests)]
    record = AuditRecord("peer", "", "model", "r", 512, 256, {0: "length"})

    def front(call: _Call) -> str:
        span = _generate_span(request, "model", call)  # type: ignore[arg-type]
        assert span is not None
        _request_attributes(span, req)
        parent = traceparent_of(span)
        _first_token(span, record.started)
        _end_generate_span(span, record)
        return parent

    def core(parent: str) -> None:
        trace = RequestTrace(parent)
        trace.scheduled(7, 0)
        trace.first_token()
        trace.output_tokens = 256
        trace.end(aborted=False)

    parents = [front(c) for c in calls[:50]]  # warm
    t0 = time.perf_counter()
    parents = [front(c) for c in calls]
    t1 = time.perf_counter()
    for p in parents:
        core(p)
    t2 = time.perf_counter()
    spans = exporter.get_finished_spans()[-2 * args.requests:]
    t3 = time.perf_counter()
    for i in range(0, len(spans), 512):  # the batch processor's default batch size
        encode_spans(spans[i:i + 512]).SerializeToString()
    t4 = time.perf_counter()
    n = args.requests
    rows: list[dict[str, Any]] = [
        {"part": "front: Generate span", "us_per_request": (t1 - t0) / n * 1e6},
        {"part": "engine core: request span", "us_per_request": (t2 - t1) / n * 1e6},
        {"part": "export: OTLP encoding of both spans", "us_per_request": (t4 - t3) / n * 1e6},
    ]
    rows.append({"part": "total", "us_per_request": sum(r["us_per_request"] for r in rows)})
    config = {"requests": n, "revision": git_revision(),
              "note": "one process; the parts run in the front's and the core's processes"}
    write_json(args.out, config, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
