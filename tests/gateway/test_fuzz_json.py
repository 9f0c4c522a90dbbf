"""Property-based fuzzing of the gateway's JSON (Hypothesis), over a scripted fake router:
any body posted to the completions and chat completions endpoints (any JSON value, known
fields with values of any type and range, unknown fields, invalid UTF-8) gets 200 or a
client error whose body is an OpenAI-style error naming the problem, never a 500, never a
hang; a request the gateway accepts reaches the router as one well-formed call per prompt
and choice group."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.gateway.test_app_asgi import CHUNK, FakeRouter, _app, _call

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "n", "stream", "stream_options", "stop", "seed",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
          "top_logprobs", "user", "echo", "best_of", "logit_bias", "response_format",
          "tools", "ignore_eos", "suffix", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar", "use_beam_search", "length_penalty", "early_stopping"]

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8)
_messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=20)}),
    min_size=1, max_size=3)
_valid = {
    "model": st.just("fake"),
    "prompt": st.text(min_size=1, max_size=20) | st.lists(st.text(min_size=1, max_size=8),
                                                          min_size=1, max_size=3),
    "messages": _messages,
    "max_tokens": st.integers(1, 40), "max_completion_tokens": st.integers(1, 40),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "n": st.integers(1, 3), "stream": st.booleans(),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4),
                                                        max_size=4),
    "seed": st.integers(0, 2**32), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "user": st.text(max_size=8), "ignore_eos": st.booleans(),
}
_wild = {
    "messages": st.lists(st.fixed_dictionaries({"role": _json, "content": _json}),
                         max_size=3) | _json,
}


def _mix(valid: st.SearchStrategy, wild: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a valid value (so many requests pass), one time in six anything."""
    return st.integers(0, 5).flatmap(lambda i: wild if i == 0 else valid)


@st.composite
def posts(draw: st.DrawFn) -> tuple[str, bytes]:
    """(path, body): mostly a request of the path's shape with a few odd fields; sometimes
    any JSON value, or bytes that may not be UTF-8 or JSON at all."""
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    kind = draw(st.sampled_from(["object"] * 6 + ["json", "bytes"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=40))
    if kind == "json":
        return path, json.dumps(draw(_json)).encode()
    names = {"messages" if chat else "prompt"} | set(
        draw(st.lists(st.sampled_from(FIELDS), max_size=5, unique=True)))
    body: dict[str, Any] = {}
    for name in sorted(names):
        valid = _valid.get(name)
        wild = _wild.get(name, _json)
        body[name] = draw(_mix(valid, wild) if valid is not None else wild)
    return path, json.dumps(body).encode()


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(post=posts())
def test_any_body_gets_a_response_or_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path, post: tuple[str, bytes]
                                                   ) -> None:
    path, raw = post
    fake = FakeRouter([CHUNK])
    status, body = asyncio.run(_call(_app(fake, monkeypatch, tmp_path), path, raw))
    event(str(status))
    assert status in (200, 400, 404, 413, 422), (status, body, raw)
    if status == 200:
        assert fake.requests, raw  # accepted: the router was called
        if body.startswith(b"data: "):
            assert body.rstrip().endswith(b"data: [DONE]"), body
        else:
            assert json.loads(body)["choices"], body
        for request in fake.requests:  # well-formed: an input (the router judges the model)
            assert request.WhichOneof("input") is not None
    else:
        assert not fake.requests, (status, raw)  # refused before any router call
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"], body
        assert error["type"] in ("invalid_request_error", "not_found_error"), body
