"""Request validation: every bad-input case of RELIABILITY.md that is not HTTP-specific is a
ValidationError naming the field and the limit; good requests come out tokenized and fitted."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundation.sampling_params import SamplingParams
from foundation.tokenizer import ModelTokenizer
from router.requests import (
    ChatMessage,
    ChatPrompt,
    GenerateRequest,
    RawGenerateRequest,
    RequestLimits,
    TextPrompt,
    TokenPrompt,
)
from router.validation import ValidationError, validate_request
from tests.default_model import default_model_dir

LIMITS = RequestLimits(max_model_len=8192, vocab_size=49152, max_tokens_cap=4096, max_n=8,
                       max_logprobs=20, max_stop_sequences=4, max_stop_len=256,
                       max_stop_token_ids=8, max_prompt_chars=100_000)
BASE = RawGenerateRequest(request_id="r1", prompt=TokenPrompt(tuple(range(100, 220))),
                          max_tokens=16)


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer.from_dir(default_model_dir())


def _sampling(**kw: Any) -> SamplingParams:
    return SamplingParams(**kw)


def test_valid_token_prompt_passes_through(tok: ModelTokenizer) -> None:
    raw = replace(BASE, stop=("\n\n",), stop_token_ids=(2, 7), ignore_eos=True, n=3,
                  priority=-5, include_stop_str_in_output=True, skip_special_tokens=False,
                  sampling=_sampling(temperature=0.7, top_p=0.9, seed=11, logprobs=5))
    assert validate_request(raw, LIMITS, tok) == GenerateRequest(
        request_id="r1", prompt_token_ids=tuple(range(100, 220)), sampling=raw.sampling,
        max_tokens=16, stop=("\n\n",), stop_token_ids=(2, 7), ignore_eos=True, n=3,
        priority=-5, include_stop_str_in_output=True, skip_special_tokens=False)


def test_truncation_keeps_the_prompts_last_tokens(tok: ModelTokenizer) -> None:
    """vLLM's truncate_prompt_tokens, for every prompt form; a prompt too long for the
    context fits once truncated, and max_tokens is fitted to what is kept."""
    long = replace(BASE, prompt=TokenPrompt(tuple(range(9000))), truncate_prompt_tokens=100,
                   max_tokens=None)
    got = validate_request(long, LIMITS, tok)
    assert got.prompt_token_ids == tuple(range(8900, 9000)) and got.max_tokens == 4096
    text = replace(BASE, prompt=TextPrompt("one two three four five"),
                   truncate_prompt_tokens=2)
    assert validate_request(text, LIMITS, tok).prompt_token_ids == \
        tuple(tok.encode("one two three four five")[-2:])
    short = replace(BASE, truncate_prompt_tokens=1000)  # longer than the prompt: all kept
    assert validate_request(short, LIMITS, tok).prompt_token_ids == tuple(range(100, 220))


def test_text_prompt_is_tokenized(tok: ModelTokenizer) -> None:
    raw = replace(BASE, prompt=TextPrompt("Hello there, 你好 🎉"))
    assert validate_request(raw, LIMITS, tok).prompt_token_ids == \
        tuple(tok.encode("Hello there, 你好 🎉"))


def test_chat_prompt_goes_through_the_template(tok: ModelTokenizer) -> None:
    messages = (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi ✨"))
    raw = replace(BASE, prompt=ChatPrompt(messages))
    want = tok.encode_chat([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi ✨"}])
    assert validate_request(raw, LIMITS, tok).prompt_token_ids == tuple(want)


@pytest.mark.parametrize(("max_model_len", "cap", "want"), [
    (8192, 4096, 4096),  # the cap binds
    (200, 4096, 80),  # the remaining context binds: 200 - 120 prompt tokens
    (121, 4096, 1),
])
def test_missing_max_tokens_defaults_to_remaining_context(
        tok: ModelTokenizer, max_model_len: int, cap: int, want: int) -> None:
    limits = replace(LIMITS, max_model_len=max_model_len, max_tokens_cap=cap)
    assert validate_request(replace(BASE, max_tokens=None), limits, tok).max_tokens == want


OUT_OF_VOCAB = 50000
BAD = [
    # (changes to BASE, limits changes, field, exact message)
    ({"max_tokens": 0}, {}, "max_tokens", "max_tokens must be between 1 and 4096, got 0"),
    ({"max_tokens": -3}, {}, "max_tokens", "max_tokens must be between 1 and 4096, got -3"),
    ({"max_tokens": 4097}, {}, "max_tokens",
     "max_tokens must be between 1 and 4096, got 4097"),
    ({"max_tokens": 8100}, {"max_tokens_cap": 8192}, "max_tokens",
     "prompt (120 tokens) + max_tokens (8100) = 8220 exceeds the model's context of 8192"),
    ({"prompt": TokenPrompt((5,) * 9000)}, {}, "prompt_token_ids",
     "prompt has 9000 tokens, more than the model's context of 8192"),
    ({"prompt": TokenPrompt((5,) * 8192), "max_tokens": None}, {}, "prompt_token_ids",
     "prompt has 8192 tokens, which fills the model's context of 8192 and leaves no room "
     "to generate"),
    ({"prompt": TextPrompt(" ".join(["word"] * 300))}, {"max_model_len": 256}, "prompt",
     "prompt has 300 tokens, more than the model's context of 256"),
    ({"prompt": TextPrompt("x" * 101)}, {"max_prompt_chars": 100}, "prompt",
     "prompt is 101 characters, at most 100 are allowed"),
    ({"prompt": ChatPrompt((ChatMessage("user", "x" * 60),) * 2)}, {"max_prompt_chars": 100},
     "messages", "messages have 120 characters of content, at most 100 are allowed"),
    ({"sampling": _sampling(temperature=-0.5)}, {}, "temperature",
     "temperature must be a finite number >= 0, got -0.5"),
    ({"sampling": _sampling(temperature=float("nan"))}, {}, "temperature",
     "temperature must be a finite number >= 0, got nan"),
    ({"sampling": _sampling(top_p=0.0)}, {}, "top_p", "top_p must be in (0, 1], got 0.0"),
    ({"sampling": _sampling(top_p=1.5)}, {}, "top_p", "top_p must be in (0, 1], got 1.5"),
    ({"sampling": _sampling(top_k=-2)}, {}, "top_k",
     "top_k must be -1 or 0 (off) or in [1, 49152], got -2"),
    ({"sampling": _sampling(min_p=-0.1)}, {}, "min_p", "min_p must be in [0, 1], got -0.1"),
    ({"sampling": _sampling(min_p=1.1)}, {}, "min_p", "min_p must be in [0, 1], got 1.1"),
    ({"sampling": _sampling(presence_penalty=2.5)}, {}, "presence_penalty",
     "presence_penalty must be in [-2.0, 2.0], got 2.5"),
    ({"sampling": _sampling(frequency_penalty=-3.0)}, {}, "frequency_penalty",
     "frequency_penalty must be in [-2.0, 2.0], got -3.0"),
    ({"sampling": _sampling(repetition_penalty=0.0)}, {}, "repetition_penalty",
     "repetition_penalty must be a finite number > 0, got 0.0"),
    ({"sampling": _sampling(seed=2**64)}, {}, "seed",
     f"seed must be in [{-(2**63)}, {2**64 - 1}], got {2**64}"),
    ({"sampling": _sampling(logprobs=21)}, {}, "logprobs",
     "logprobs must be None or in [0, 20], got 21"),
    ({"n": 0}, {}, "n", "n must be between 1 and 8, got 0"),
    ({"n": 9}, {}, "n", "n must be between 1 and 8, got 9"),
    ({"priority": 2**31}, {}, "priority",
     f"priority must be between {-(2**31)} and {2**31 - 1}, got {2**31}"),
    ({"request_id": ""}, {}, "request_id", "request_id must not be empty"),
    ({"prompt": TextPrompt("")}, {}, "prompt", "prompt must not be empty"),
    ({"prompt": TokenPrompt(())}, {}, "prompt_token_ids", "prompt_token_ids must not be empty"),
    ({"prompt": ChatPrompt(())}, {}, "messages", "messages must not be empty"),
    ({"prompt": ChatPrompt((ChatMessage("system", "s"), ChatMessage("user", "u"),
                            ChatMessage("wizard", "w")))}, {}, "messages[2].role",
     "messages[2].role 'wizard' is not one of system, user, assistant, tool"),
    ({"prompt": TokenPrompt((1, 2, 3, OUT_OF_VOCAB))}, {}, "prompt_token_ids[3]",
     "prompt_token_ids[3] = 50000 is outside the vocabulary [0, 49152)"),
    ({"prompt": TokenPrompt((-1,))}, {}, "prompt_token_ids[0]",
     "prompt_token_ids[0] = -1 is outside the vocabulary [0, 49152)"),
    ({"stop": ("a",) * 9}, {}, "stop", "stop has 9 sequences, at most 4 are allowed"),
    ({"stop": ("x" * 600,)}, {}, "stop[0]", "stop[0] is 600 characters, at most 256 are allowed"),
    ({"stop": ("ok", "")}, {}, "stop[1]", "stop[1] is empty; stop strings must have a character"),
    ({"stop_token_ids": (2, 49152)}, {}, "stop_token_ids[1]",
     "stop_token_ids[1] = 49152 is outside the vocabulary [0, 49152)"),
    ({"stop_token_ids": (2,) * 9}, {}, "stop_token_ids",
     "stop_token_ids has 9 ids, at most 8 are allowed"),
    ({"truncate_prompt_tokens": 0}, {}, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be between 1 and 8191, got 0"),
    ({"truncate_prompt_tokens": 8192}, {}, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be between 1 and 8191, got 8192"),
]


@pytest.mark.parametrize(("changes", "limit_changes", "field", "message"), BAD)
def test_bad_input_names_field_and_limit(tok: ModelTokenizer, changes: dict[str, Any],
                                         limit_changes: dict[str, Any], field: str,
                                         message: str) -> None:
    with pytest.raises(ValidationError) as info:
        validate_request(replace(BASE, **changes), replace(LIMITS, **limit_changes), tok)
    assert (info.value.field, str(info.value)) == (field, message)
    assert isinstance(info.value, ValueError)


def test_chat_template_refusal_is_a_validation_error(tok: ModelTokenizer) -> None:
    no_template = ModelTokenizer(tok.tokenizer, {}, [])
    raw = replace(BASE, prompt=ChatPrompt((ChatMessage("user", "hi"),)))
    with pytest.raises(ValidationError) as info:
        validate_request(raw, LIMITS, no_template)
    assert info.value.field == "messages"
    assert str(info.value) == "messages: this model has no chat template; send a plain prompt"


def test_roles_come_from_the_limits(tok: ModelTokenizer) -> None:
    raw = replace(BASE, prompt=ChatPrompt((ChatMessage("tool", "42"),)))
    limits = replace(LIMITS, allowed_roles=("user", "assistant"))
    with pytest.raises(ValidationError, match="'tool' is not one of user, assistant"):
        validate_request(raw, limits, tok)


class _NoTokenizer:
    """Fails the test if validation tokenizes: cheap checks must come first."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("tokenized a request that cheap checks refuse")

    def encode_chat(self, messages: Sequence[dict[str, Any]],
                    add_generation_prompt: bool = True) -> list[int]:
        raise AssertionError("tokenized a request that cheap checks refuse")


@pytest.mark.parametrize("changes", [
    {"n": 0}, {"max_tokens": 0}, {"stop": ("a",) * 9},
    {"sampling": _sampling(top_p=2.0)}, {"stop_token_ids": (-1,)},
    {"prompt": TextPrompt("x" * 100_001)},
])
def test_refused_before_tokenizing(changes: dict[str, Any]) -> None:
    raw = replace(BASE, prompt=TextPrompt("fine")) if "prompt" not in changes else BASE
    with pytest.raises(ValidationError):
        validate_request(replace(raw, **changes), LIMITS, _NoTokenizer())


@pytest.mark.parametrize("bad", [
    {"max_model_len": 0}, {"vocab_size": 0}, {"max_n": 0}, {"max_logprobs": -1},
    {"allowed_roles": ()},
])
def test_limits_refuse_nonsense(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="RequestLimits"):
        replace(LIMITS, **bad)


@settings(max_examples=200, deadline=None)
@given(num_prompt=st.integers(1, 300), max_tokens=st.one_of(st.none(), st.integers(-5, 400)),
       context=st.integers(1, 300), cap=st.integers(1, 300))
def test_prompt_and_max_tokens_always_fit(tok: ModelTokenizer, num_prompt: int,
                                          max_tokens: int | None, context: int,
                                          cap: int) -> None:
    limits = replace(LIMITS, max_model_len=context, max_tokens_cap=cap)
    raw = replace(BASE, prompt=TokenPrompt((7,) * num_prompt), max_tokens=max_tokens)
    try:
        req = validate_request(raw, limits, tok)
    except ValidationError as e:
        if max_tokens is not None and not 1 <= max_tokens <= cap:
            assert e.field == "max_tokens" and "between 1 and" in e.message
        elif num_prompt >= context:
            assert e.field == "prompt_token_ids"
        else:
            assert e.field == "max_tokens" and num_prompt + (max_tokens or 0) > context
        return
    assert 1 <= req.max_tokens <= cap
    assert num_prompt + req.max_tokens <= context
    if max_tokens is None:
        assert req.max_tokens == min(cap, context - num_prompt)
    else:
        assert req.max_tokens == max_tokens


def test_router_request_modules_import_no_torch_or_numpy() -> None:
    code = ("import sys, router.requests, router.validation, router.detokenizer, router.stop;"
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy'});"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
