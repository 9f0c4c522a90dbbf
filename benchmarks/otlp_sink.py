"""A minimal OTLP/gRPC trace collector: it counts the spans exported to it by service, and
keeps them with `keep=True` (the trace test reads them), so a run with tracing on pays the
export as a real deployment does, without a collector process beside it.

    with OtlpSink() as sink:  # sink.endpoint -> --otlp-traces-endpoint
        ...
    sink.spans  # {"stagemesh-router": 256, ...}; sink.kept: [(service, Span), ...]
"""

from __future__ import annotations

from collections import Counter
from concurrent import futures
from types import TracebackType
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


class OtlpSink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, keep: bool = False) -> None:
        self.spans: Counter[str] = Counter()
        self.kept: list[tuple[str, trace_pb2.Span]] | None = [] if keep else None
        self._server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.endpoint = f"http://127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"

    def Export(self, request: Any, context: Any) -> Any:
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope in resource_spans.scope_spans:
                self.spans[service] += len(scope.spans)
                if self.kept is not None:
                    self.kept.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def __enter__(self) -> OtlpSink:
        self._server.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.stop(0)
