"""OpenTelemetry traces (opentelemetry-sdk), off unless asked for: one trace per request
across the gateway, the router and (later) the stages, its context carried as W3C
`traceparent` in HTTP headers and gRPC metadata.

Turned on by a service's `--otlp-traces-endpoint URL` (as vLLM's flag) or by the standard
environment: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`
(`OTEL_TRACES_EXPORTER=none` turns it off again). The sampler is the SDK's, from
`OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (default: parent-based, always on); the
service name from `OTEL_SERVICE_NAME`, else the service's own ("stagemesh-router", ...).
Spans go out in batches over OTLP/gRPC from a background thread (the SDK sends what is left
when the process exits). Off, `tracer()` is None
and the services do no tracing work at all. docs/OBSERVABILITY.md lists the spans.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None


def traces_endpoint(flag: str | None) -> str | None:
    """Where spans go: the flag, else the standard environment; None = tracing off."""
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    return (flag or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def setup_tracing(service: str, endpoint_flag: str | None) -> trace.Tracer | None:
    """Start exporting this process's spans if tracing is on (see `traces_endpoint`); the
    tracer, or None when off. Call once, early in a service's process."""
    global _tracer
    endpoint = traces_endpoint(endpoint_flag)
    if endpoint is None:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or service
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    insecure = not endpoint.startswith("https://")
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=endpoint, insecure=insecure)))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("stagemesh")
    return _tracer


def tracer() -> trace.Tracer | None:
    """This process's tracer, or None when tracing is off."""
    return _tracer


class _PairsGetter(Getter[Sequence[tuple[str, str | bytes]]]):
    """Reads a carrier of (key, value) pairs: gRPC invocation metadata."""

    def get(self, carrier: Sequence[tuple[str, str | bytes]], key: str) -> list[str] | None:
        values = [v if isinstance(v, str) else v.decode("latin-1")
                  for k, v in carrier if k == key]
        return values or None

    def keys(self, carrier: Sequence[tuple[str, str | bytes]]) -> list[str]:
        return [k for k, _ in carrier]


def context_from_headers(headers: Mapping[str, str]) -> otel_context.Context:
    """The trace context a client sent (W3C `traceparent`, header names in lower case)."""
    return _PROPAGATOR.extract(headers)


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None
                          ) -> otel_context.Context:
    """The trace context a gRPC caller sent in its metadata."""
    return _PROPAGATOR.extract(list(metadata or ()), getter=_PairsGetter())


def traceparent_of(span: trace.Span) -> str:
    """The W3C `traceparent` that makes `span` the parent ("" for a span not recorded)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def current_metadata() -> list[tuple[str, str]]:
    """gRPC metadata that carries the current span's context to the callee ([] without a
    span: then nothing is added to a call)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return list(carrier.items())
