"""OpenTelemetry traces from a real mesh to an OTLP collector started here (the OTLP trace
service of the OpenTelemetry proto package on loopback, `benchmarks.otlp_sink`): a request
that carries a W3C `traceparent` yields one connected trace across the gateway, the router
and every stage: the client's span the parent of the gateway's, the gateway's the parent of
the router's (with the GenAI attributes), the router's the parent of the engine core's
span of the request (its queue and prefill times) and of each stage's span of the step that
computed the request's prompt and of its sampled later steps."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from benchmarks.otlp_sink import OtlpSink
from foundation.ports import free_port
from router.client import build_request
from tests.mesh.harness import Mesh

pytestmark = pytest.mark.slow

INTERVAL = 4  # --trace-step-interval


def _trace(sink: OtlpSink, trace_id: bytes, want: dict[str, int], timeout: float = 30
           ) -> dict[str, list[trace_pb2.Span]]:
    """The spans of `trace_id` by service, once each service of `want` sent as many."""
    assert sink.kept is not None
    deadline = time.monotonic() + timeout
    while True:
        found: dict[str, list[trace_pb2.Span]] = {}
        for service, span in list(sink.kept):
            if span.trace_id == trace_id:
                found.setdefault(service, []).append(span)
        if all(len(found.get(s, ())) >= n for s, n in want.items()) \
                or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _attrs(span: trace_pb2.Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        value = getattr(a.value, kind)
        out[a.key] = [getattr(v, v.WhichOneof("value")) for v in value.values] \
            if kind == "array_value" else value
    return out


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[Mesh, OtlpSink]]:
    with OtlpSink(keep=True) as sink, pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s, not 5
        with Mesh("--stages", "2", "--num-blocks", "256", "--otlp-traces-endpoint",
                  sink.endpoint, "--trace-step-interval", str(INTERVAL),
                  gateway_port=free_port()) as mesh:
            yield mesh, sink


def _traceparent() -> tuple[bytes, bytes, str]:
    trace_id, span_id = secrets.token_bytes(16), secrets.token_bytes(8)
    return trace_id, span_id, f"00-{trace_id.hex()}-{span_id.hex()}-01"


def test_one_http_request_is_one_connected_trace(traced: tuple[Mesh, OtlpSink]) -> None:
    mesh, sink = traced
    trace_id, client_span, header = _traceparent()
    assert mesh.gateway_url is not None
    reply = httpx.post(mesh.gateway_url + "/v1/completions", timeout=60,
                       headers={"traceparent": header},
                       json={"prompt": "Hello there", "max_tokens": 4, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    spans = _trace(sink, trace_id, {"stagemesh-gateway": 1, "stagemesh-router": 2,
                                    "stagemesh-stage": 2})
    assert [len(spans.get(s, ())) for s in ("stagemesh-gateway", "stagemesh-router")] \
        == [1, 2], spans
    (gateway,) = spans["stagemesh-gateway"]
    (router,), (core,) = _split(spans["stagemesh-router"], "engine core")
    assert gateway.parent_span_id == client_span
    assert router.parent_span_id == gateway.span_id
    assert gateway.name == "POST /v1/completions"
    assert gateway.kind == router.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert _attrs(gateway)["http.response.status_code"] == 200
    attrs = _attrs(router)
    model = reply.json()["model"]
    assert router.name == f"text_completion {model}"
    assert attrs["gen_ai.request.model"] == model
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["gen_ai.usage.input_tokens"] == reply.json()["usage"]["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == 4
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < attrs["gen_ai.server.time_to_first_token"] < 60
    assert [e.name for e in router.events] == ["first_token"]
    assert router.start_time_unix_nano >= gateway.start_time_unix_nano
    assert router.end_time_unix_nano <= gateway.end_time_unix_nano
    # the engine core's share: queued, its first chunk planned, its first token back
    assert core.parent_span_id == router.span_id
    core_attrs = _attrs(core)
    assert [e.name for e in core.events] == ["scheduled", "first_token"]
    assert core_attrs["stagemesh.request.output_tokens"] == 4
    assert core_attrs["stagemesh.request.aborted"] is False
    assert core_attrs["stagemesh.request.queue_ms"] >= 0
    assert 0 < core_attrs["stagemesh.request.prefill_ms"] < 60_000
    assert router.start_time_unix_nano <= core.start_time_unix_nano
    # each stage's span of the step that computed the prompt, in pipeline order
    prompt_step = core_attrs["stagemesh.request.first_step"]
    first, second = sorted(
        (s for s in spans["stagemesh-stage"] if _attrs(s)["stagemesh.step.id"] == prompt_step),
        key=lambda s: _attrs(s)["stagemesh.stage.layers"] != "0-14")
    for span, layers in ((first, "0-14"), (second, "15-29")):
        a = _attrs(span)
        assert span.parent_span_id == router.span_id
        assert a["stagemesh.stage.layers"] == layers
        assert a["stagemesh.step.tokens"] == attrs["gen_ai.usage.input_tokens"]
        assert a["stagemesh.step.id"] == _attrs(first)["stagemesh.step.id"]
        assert router.start_time_unix_nano <= span.start_time_unix_nano \
            <= span.end_time_unix_nano <= router.end_time_unix_nano
    assert _attrs(first)["stagemesh.hop.transport"] == "unix"  # two processes of one host
    assert "stagemesh.hop.transport" not in _attrs(second)  # the last stage samples
    assert _attrs(second)["stagemesh.stage.input_wait_ms"] > 0  # it waited for stage 0


def test_every_interval_th_step_of_a_traced_request_is_a_span_on_each_stage(
        traced: tuple[Mesh, OtlpSink]) -> None:
    mesh, sink = traced
    trace_id, _ = _generate_traced(mesh, "Count", 24)
    spans = _trace(sink, trace_id, {"stagemesh-router": 2})
    (router,), (core,) = _split(spans["stagemesh-router"], "engine core")
    sampled = _attrs(core)["stagemesh.request.sampled_steps"]
    assert sampled >= 24 // INTERVAL - 2  # its decode steps, each stage: one in INTERVAL
    spans = _trace(sink, trace_id, {"stagemesh-stage": 2 * (1 + sampled)})
    steps: dict[int, set[str]] = {}
    for span in spans["stagemesh-stage"]:
        a = _attrs(span)
        assert span.parent_span_id == router.span_id
        steps.setdefault(a["stagemesh.step.id"], set()).add(a["stagemesh.stage.layers"])
    later = sorted(s for s in steps if s != _attrs(core)["stagemesh.request.first_step"])
    assert len(later) == sampled and all(s % INTERVAL == 0 for s in later)
    assert all(layers == {"0-14", "15-29"} for layers in steps.values())  # both stages


def _generate_traced(mesh: Mesh, prompt: str, max_tokens: int) -> tuple[bytes, bytes]:
    """One gRPC Generate under a fresh client trace: (its trace id, the client's span id)."""
    trace_id, client_span, header = _traceparent()
    chunks = list(mesh.stub().Generate(
        build_request(prompt, max_tokens=max_tokens, ignore_eos=True),
        metadata=[("traceparent", header)], timeout=60))
    assert chunks
    return trace_id, client_span


def _split(spans: list[trace_pb2.Span], name: str
           ) -> tuple[list[trace_pb2.Span], list[trace_pb2.Span]]:
    """(the spans not named `name`, those named so)."""
    return [s for s in spans if s.name != name], [s for s in spans if s.name == name]


def test_a_grpc_caller_traceparent_is_the_router_span_parent(
        traced: tuple[Mesh, OtlpSink]) -> None:
    mesh, sink = traced
    trace_id, client_span = _generate_traced(mesh, "Hi", 2)
    (router,), _ = _split(_trace(sink, trace_id, {"stagemesh-router": 2})["stagemesh-router"],
                          "engine core")
    assert router.parent_span_id == client_span
    assert _attrs(router)["gen_ai.usage.output_tokens"] == 2
