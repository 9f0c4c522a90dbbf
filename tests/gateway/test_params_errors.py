"""Request parsing and the one gRPC -> HTTP error mapping, without processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from foundation.api_keys import load_api_keys
from gateway.config import GatewayConfig
from gateway.errors import APIError, from_rpc_error
from gateway.params import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    Prompt,
    parse_chat,
    parse_completions,
)


def _rpc(code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
         ) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(*trailing), details=details)


@pytest.mark.parametrize(("code", "status", "kind"), [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
    (grpc.StatusCode.INTERNAL, 500, "server_error"),
    (grpc.StatusCode.UNKNOWN, 500, "server_error"),
])
def test_status_mapping(code: grpc.StatusCode, status: int, kind: str) -> None:
    err = from_rpc_error(_rpc(code, "something happened"))
    assert (err.status, err.type) == (status, kind)
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert "something happened" in body["message"]


def test_retry_after_comes_from_the_router_trailer() -> None:
    err = from_rpc_error(_rpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy",
                              (("retry-after", "7"),)))
    assert err.headers == {"Retry-After": "7"}
    assert from_rpc_error(_rpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")).headers == {
        "Retry-After": "1"}


@pytest.mark.parametrize(("details", "rename", "param"), [
    ("max_tokens must be between 1 and 4096, got 0", None, "max_tokens"),
    ("max_tokens must be between 1 and 4096, got 0", {"max_tokens": "max_completion_tokens"},
     "max_completion_tokens"),
    ("messages[2].role 'wizard' is not one of system, user", None, "messages[2].role"),
    ("prompt_token_ids[3] = -1 is outside the vocabulary [0, 10)",
     {"prompt_token_ids": "prompt"}, "prompt[3]"),
    ("stop[0] is empty; stop strings must have a character", None, "stop[0]"),
    ("messages: chat template failed", None, "messages"),
    ("logprobs must be None or in [0, 20], got 50", {"logprobs": "top_logprobs"},
     "top_logprobs"),
    ("the prompt has 5000 tokens; the limit is 4095", None, None),
    ("prompt has no tokens", {"prompt": "messages"}, "messages"),
])
def test_invalid_argument_param_is_the_field_the_router_named(
        details: str, rename: dict[str, str] | None, param: str | None) -> None:
    err = from_rpc_error(_rpc(grpc.StatusCode.INVALID_ARGUMENT, details), rename)
    assert err.param == param
    assert err.message == details


def test_completions_prompt_forms() -> None:
    def prompts(value: Any) -> tuple[Prompt, ...]:
        return parse_completions({"prompt": value}, max_prompts=4).prompts

    assert prompts("hi") == (Prompt(text="hi"),)
    assert prompts([1, 2]) == (Prompt(token_ids=(1, 2)),)
    assert prompts(["a", "b"]) == (Prompt(text="a"), Prompt(text="b"))
    assert prompts([[1], [2, 3]]) == (Prompt(token_ids=(1,)), Prompt(token_ids=(2, 3)))
    assert prompts(["a", [5]]) == (Prompt(text="a"), Prompt(token_ids=(5,)))
    with pytest.raises(APIError) as many:
        prompts(["x"] * 5)
    assert many.value.param == "prompt" and "at most 4" in many.value.message
    with pytest.raises(APIError) as empty:
        prompts([])
    assert empty.value.param == "prompt"


def test_completions_defaults_and_router_options() -> None:
    spec = parse_completions({"prompt": "hi"}, max_prompts=4)
    assert spec.options["max_tokens"] == COMPLETIONS_DEFAULT_MAX_TOKENS  # OpenAI's default
    assert spec.n == 1 and spec.logprobs is None and not spec.stream
    spec = parse_completions({"prompt": "hi", "n": 3, "logprobs": 2, "seed": 9, "stop": "x",
                              "temperature": 0, "top_k": 5, "max_tokens": 7.0,
                              "stream": True, "stream_options": {"include_usage": True},
                              "best_of": 3, "echo": False}, max_prompts=4)
    assert spec.n == 3 and spec.logprobs == 2 and spec.include_usage
    assert spec.options.items() >= {"n": 3, "logprobs": 2, "seed": 9, "stop": ("x",),
                                     "temperature": 0.0, "top_k": 5, "max_tokens": 7}.items()


def test_chat_options() -> None:
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                              {"type": "text", "text": "b"}]},
            {"role": "user", "content": "hi", "name": "ignored"},
            {"role": "assistant", "content": None}]
    spec = parse_chat({"messages": msgs, "max_tokens": 5, "max_completion_tokens": 9,
                       "logprobs": True, "top_logprobs": 4, "user": "u-1"})
    assert spec.prompts[0].messages == ({"role": "system", "content": "a\nb"},
                                        {"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": ""})
    assert spec.options["max_tokens"] == 9 and spec.max_tokens_field == "max_completion_tokens"
    assert spec.logprobs == 4 and spec.user == "u-1"
    assert parse_chat({"messages": msgs, "logprobs": True}).logprobs == 0
    assert parse_chat({"messages": msgs, "logprobs": False}).logprobs is None
    assert parse_chat({"messages": msgs}).options["max_tokens"] is None  # the router decides


def test_api_keys_from_every_source(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\n  k-file  \n\n")
    keys = load_api_keys(["k-flag", " "], " k-env1 ,k-env2,,", key_file)
    assert keys == {"k-flag", "k-file", "k-env1", "k-env2"}
    assert load_api_keys([], None, None) == frozenset()
    with pytest.raises(ValueError):
        GatewayConfig(api_keys=frozenset({" padded"}))


@pytest.mark.parametrize("parse", [
    lambda body: parse_completions({"prompt": "hi", **body}, max_prompts=4),
    lambda body: parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}),
])
def test_unknown_fields_are_refused_by_name(parse: Any) -> None:
    """A vLLM extension this server does not implement must not be silently ignored."""
    with pytest.raises(APIError) as one:
        parse({"allowed_token_ids": [1, 2]})
    assert one.value.status == 400 and one.value.param == "allowed_token_ids"
    assert "allowed_token_ids" in one.value.message
    with pytest.raises(APIError) as two:
        parse({"bad_words": ["x"], "guided_whitespace_pattern": " ", "temperature": 0})
    assert two.value.param == "bad_words"  # the first, by name; both named
    assert "bad_words, guided_whitespace_pattern" in two.value.message
    with pytest.raises(APIError) as nested:
        parse({"stream": True, "stream_options": {"include_usage": True, "extra": 1}})
    assert nested.value.param == "stream_options.extra"
    assert parse({"stream": True, "stream_options": {"include_usage": True,
                                                     "continuous_usage_stats": True}}
                 ).continuous_usage
    assert not parse({"stream": True, "stream_options": {"continuous_usage_stats": True}}
                     ).continuous_usage  # as vLLM: only with include_usage
    # OpenAI fields that change nothing computed are accepted (and ignored)
    spec = parse({"metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                  "prompt_cache_key": "p", "safety_identifier": "s", "user": "u"})
    assert spec.user == "u"
    # null reads as unset for a known field, and a known field at its default is no error
    parse({"seed": None, "include_stop_str_in_output": True})


def test_chat_ignores_max_tokens_beside_max_completion_tokens() -> None:
    spec = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                       "max_completion_tokens": 5})
    assert spec.options["max_tokens"] == 5
