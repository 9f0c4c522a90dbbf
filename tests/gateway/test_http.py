"""Raw HTTP against the mesh's gateway: every error in OpenAI's shape with the right status
and `param`, the route allow-list, body limits, SSE framing, health, readiness, metrics."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest

from tests.gateway.conftest import MAX_QUEUED_TOKENS, MODEL
from tests.prom import sample

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return dict(body["error"])


@pytest.mark.parametrize("content", [b"{", b'{"prompt": "hi",}', b"", b"NaN",
                                     b'{"prompt": "hi", "temperature": NaN}'])
def test_invalid_json_is_400(http: httpx.Client, content: bytes) -> None:
    err = _error(http.post("/v1/completions", content=content), 400)
    assert "JSON" in err["message"] and err["type"] == "invalid_request_error"


def test_invalid_utf8_is_400(http: httpx.Client) -> None:
    err = _error(http.post("/v1/completions", content=b'{"prompt": "caf\xe9"}'), 400)
    assert "UTF-8" in err["message"]


@pytest.mark.parametrize(("content", "param"), [
    (rb'{"prompt": "\ud800"}', "prompt"), (rb'{"prompt": ["a", "b\udfff"]}', "prompt[1]"),
    (rb'{"prompt": "a", "stop": "\ud83d"}', "stop")])
def test_lone_surrogate_is_400(http: httpx.Client, content: bytes, param: str) -> None:
    """Valid JSON, but no UTF-8 exists for it (nor a protobuf string)."""
    err = _error(http.post("/v1/completions", content=content), 400)
    assert err["param"] == param and "surrogate" in err["message"]


@pytest.mark.parametrize("content", [b"[1, 2]", b'"hello"', b"null", b"3"])
def test_non_object_body_is_400(http: httpx.Client, content: bytes) -> None:
    err = _error(http.post("/v1/chat/completions", content=content), 400)
    assert "JSON object" in err["message"]


COMPLETION_TYPES = [
    ({"prompt": 5}, "prompt"),
    ({"prompt": [[1, "a"]]}, "prompt[0][1]"),
    ({"prompt": ["a", 3]}, "prompt[1]"),
    ({"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2**40}, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "n": True}, "n"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "stop": ["ok", 1]}, "stop[1]"),
    ({"prompt": "hi", "seed": 2**70}, "seed"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    ({"prompt": "hi", "prompt_logprobs": "2"}, "prompt_logprobs"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "logit_bias": {"one": 5}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"1": "x"}}, "logit_bias.1"),
    ({"prompt": "hi", "min_tokens": 1.5}, "min_tokens"),
    ({"prompt": "hi", "model": 7}, "model"),
]
CHAT_TYPES = [
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    ({"messages": CHAT, "logprobs": 3}, "logprobs"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "max_completion_tokens": 1.5}, "max_completion_tokens"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]},
     "tools[0].x"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": CHAT, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": [1]}}}, "response_format.json_schema.schema"),
    ({"messages": CHAT, "guided_choice": "yes"}, "guided_choice"),
    ({"messages": CHAT, "guided_json": "{not json"}, "guided_json"),
    ({"messages": CHAT, "guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
]


@pytest.mark.parametrize(("body", "param"), COMPLETION_TYPES)
def test_completion_field_types_are_400_naming_the_field(http: httpx.Client,
                                                         body: dict[str, Any],
                                                         param: str) -> None:
    err = _error(http.post("/v1/completions", json=body), 400)
    assert err["param"] == param, err


@pytest.mark.parametrize(("body", "param"), CHAT_TYPES)
def test_chat_field_types_are_400_naming_the_field(http: httpx.Client, body: dict[str, Any],
                                                   param: str) -> None:
    err = _error(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param, err


ROUTER_RANGES = [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 49152]}, "prompt[2]"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 100}, "stop"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    # the default model's chat template knows no tools: no parser, so only tool_choice none
    ("/v1/chat/completions", {"messages": CHAT, "tools": [
        {"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 50},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10**5},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 5}, "presence_penalty"),
]


@pytest.mark.parametrize(("path", "body", "param"), ROUTER_RANGES)
@pytest.mark.parametrize("stream", [False, True])
def test_router_range_errors_are_400_naming_the_field(http: httpx.Client, path: str,
                                                      body: dict[str, Any], param: str,
                                                      stream: bool) -> None:
    err = _error(http.post(path, json={"model": MODEL, **body, "stream": stream}), 400)
    assert err["param"] == param, err
    assert err["code"] == "invalid_argument"


def test_unknown_model_is_404(http: httpx.Client) -> None:
    err = _error(http.post("/v1/chat/completions", json={"model": "gpt-17", "messages": CHAT}),
                 404)
    assert err["param"] == "model" and "gpt-17" in err["message"]
    err = _error(http.get("/v1/models/gpt-17"), 404)
    assert err["code"] == "model_not_found"


def test_admission_refusal_is_429_with_retry_after(http: httpx.Client) -> None:
    prompt = "word " * (MAX_QUEUED_TOKENS + 100)  # more prompt tokens than may queue
    for stream in (False, True):
        response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4,
                                                      "stream": stream})
        err = _error(response, 429)
        assert err["type"] == "rate_limit_error"
        assert int(response.headers["retry-after"]) >= 1


@pytest.mark.parametrize("path", ["/", "/v1", "/v1/embeddings", "/v1/chat", "/docs",
                                  "/v1/completions/", "/health/x"])
def test_routes_not_on_the_allow_list_are_404(http: httpx.Client, path: str) -> None:
    for method in ("GET", "POST"):
        error = _error(http.request(method, path), 404)
        assert error["code"] == "not_found" and path in error["message"], error


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/v1/completions", "POST"), ("PUT", "/v1/chat/completions", "POST"),
    ("POST", "/v1/models", "GET"), ("DELETE", "/health", "GET"), ("POST", "/metrics", "GET")])
def test_wrong_method_is_405_with_allow(http: httpx.Client, method: str, path: str,
                                        allow: str) -> None:
    response = http.request(method, path)
    _error(response, 405)
    assert response.headers["allow"] == allow


def test_oversized_body_is_413(http: httpx.Client) -> None:
    big = json.dumps({"prompt": "x" * (5 << 20)}).encode()
    err = _error(http.post("/v1/completions", content=big), 413)
    assert str(4 << 20) in err["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"x" * (1 << 20)
        yield b'"}'

    _error(http.post("/v1/completions", content=chunked()), 413)


def test_sse_framing_ends_with_done(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_health_ready_and_metrics(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").json() == {"status": "ready"}
    http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    for stage in (0, 1):
        assert re.search(rf'^stagemesh_kv_blocks_used\{{stage="{stage}"\}} [\d.]+$', text, re.M)
        assert re.search(rf'^stagemesh_kv_blocks_total\{{stage="{stage}"\}} 256.0$', text,
                         re.M)
    completions = {"route": "/v1/completions"}
    assert (sample(text, "stagemesh_gateway_requests_total", method="POST", status="200",
                   **completions) or 0) >= 1
    assert (sample(text, "stagemesh_gateway_request_duration_seconds_bucket", le="+Inf",
                   **completions) or 0) >= 1
    assert (sample(text, "stagemesh_gateway_time_to_first_token_seconds_count",
                   **completions) or 0) >= 1
    assert re.search(r"^stagemesh_router_up 1.0$", text, re.M)
    assert re.search(r"^stagemesh_router_kv_blocks_total 256.0$", text, re.M)
