"""The front's request validation by prompt length: long prompts are tokenized on the
validator's pool, short ones and token ids on the caller's loop, with the outcome of
`validate_request` either way (and the Tokenize call's answer); the tokenizer's encode
releases the interpreter lock."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from transformers import AutoTokenizer

from foundation.tokenizer import ModelTokenizer
from protos.stagemesh.v1 import inference_pb2 as pb
from router.core.messages import ServedInfo
from router.prompt_validation import (
    INLINE_PROMPT_CHARS,
    RequestValidator,
    default_workers,
    prompt_chars,
)
from router.requests import (
    ChatMessage,
    ChatPrompt,
    RawGenerateRequest,
    TextPrompt,
    TokenPrompt,
)
from router.service import InferenceServicer
from router.validation import ValidationError, validate_request
from tests.default_model import default_model_dir
from tests.router.test_validation import LIMITS

BASE = RawGenerateRequest(request_id="r1", prompt=TokenPrompt((100, 101)), max_tokens=16)
LONG_TEXT = "The quick brown fox jumps over the lazy dog; 你好 🎉. " * 60  # ~3,200 chars


class ThreadNoting:
    """The default model's tokenizer, noting the thread of each encode."""

    def __init__(self) -> None:
        self.inner = ModelTokenizer.from_dir(default_model_dir())
        self.threads: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return self.inner.encode(text, add_special_tokens)

    def encode_chat(self, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return self.inner.encode_chat(messages, tools=tools)


def test_prompt_chars_counts_what_tokenizing_reads() -> None:
    assert prompt_chars(TextPrompt("abc")) == 3
    assert prompt_chars(ChatPrompt((ChatMessage("system", "ab"),
                                    ChatMessage("user", "cde")))) == 5
    assert prompt_chars(TokenPrompt(tuple(range(5000)))) == 0
    assert len(LONG_TEXT) >= INLINE_PROMPT_CHARS


def test_long_prompts_validate_on_the_pool_short_ones_inline() -> None:
    tok = ThreadNoting()
    validate = RequestValidator(tok, None, workers=2)
    requests = [replace(BASE, prompt=TextPrompt("Hello there")),
                replace(BASE, prompt=TextPrompt(LONG_TEXT)),
                replace(BASE, prompt=ChatPrompt((ChatMessage("user", "Hi"),))),
                replace(BASE, prompt=ChatPrompt((ChatMessage("user", LONG_TEXT),)))]

    async def run() -> list[Any]:
        return [await validate(r, LIMITS) for r in requests]

    try:
        got = asyncio.run(run())
    finally:
        validate.close()
    loop_thread = threading.current_thread().name
    assert tok.threads[0] == loop_thread and tok.threads[2] == loop_thread
    assert tok.threads[1].startswith("validate") and tok.threads[3].startswith("validate")
    # the same outcome as validating inline
    assert got == [validate_request(r, LIMITS, tok) for r in requests]


def test_without_a_pool_every_prompt_validates_inline() -> None:
    """workers=0 (the default where fewer than 4 cores are usable): all on the loop."""
    tok = ThreadNoting()
    validate = RequestValidator(tok, None, workers=0)
    got = asyncio.run(validate(replace(BASE, prompt=TextPrompt(LONG_TEXT)), LIMITS))
    validate.close()
    assert tok.threads == [threading.current_thread().name]
    assert got == validate_request(replace(BASE, prompt=TextPrompt(LONG_TEXT)), LIMITS, tok)


def test_the_default_pool_follows_the_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    for cores, want in ((1, 0), (2, 0), (3, 0), (4, 1), (8, 2), (16, 4), (64, 4)):
        monkeypatch.setattr("router.prompt_validation.usable_cores", lambda n=cores: n)
        assert default_workers() == want


def test_a_long_prompts_error_comes_back_from_the_pool() -> None:
    validate = RequestValidator(ThreadNoting(), None, workers=1)
    small = replace(LIMITS, max_model_len=64)
    try:
        with pytest.raises(ValidationError) as e:
            asyncio.run(validate(replace(BASE, prompt=TextPrompt(LONG_TEXT)), small))
    finally:
        validate.close()
    assert e.value.field == "prompt"


def test_encode_releases_the_interpreter_lock_and_matches_transformers() -> None:
    """`ModelTokenizer.encode` gives HF transformers' ids, and while it tokenizes in one
    thread another thread runs Python (it would not if encode held the lock)."""
    tok = ModelTokenizer.from_dir(default_model_dir())
    hf = AutoTokenizer.from_pretrained(default_model_dir())
    text = LONG_TEXT * 40  # ~130,000 chars: tens of milliseconds of tokenizing
    assert tok.encode(text) == hf(text)["input_ids"]
    started, done = threading.Event(), threading.Event()
    ticks_while_encoding = 0

    def encode() -> None:
        started.set()
        for _ in range(5):
            tok.encode(text)
        done.set()

    worker = threading.Thread(target=encode)
    worker.start()
    started.wait()
    while not done.is_set():
        ticks_while_encoding += 1
    worker.join()
    # Holding the lock, the encode thread would leave this one a tick every switch
    # interval (5 ms) at most: a few dozen in all. Released, it spins freely.
    assert ticks_while_encoding > 10_000


def test_the_tokenize_call_tokenizes_a_long_prompt_on_the_pool() -> None:
    """The router's Tokenize answers as before, a long text tokenized on the validator's
    pool and a short one on the loop (the servicer reads only the front's `served`)."""
    tok = ModelTokenizer.from_dir(default_model_dir())
    hf = AutoTokenizer.from_pretrained(default_model_dir())
    threads: list[str] = []
    encode = tok.encode

    def noting(text: str, add_special_tokens: bool = True) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(text, add_special_tokens)

    tok.encode = noting  # type: ignore[method-assign]

    class Front:
        served: asyncio.Future[ServedInfo]

    async def run() -> list[pb.TokenizeResponse]:
        front = Front()
        front.served = asyncio.get_running_loop().create_future()
        front.served.set_result(ServedInfo(LIMITS, "float32", 1, 1, 16))
        servicer = InferenceServicer(front, tok, "m")  # type: ignore[arg-type]
        servicer.validate.close()
        servicer.validate = RequestValidator(tok, None, workers=1)
        try:
            return [await servicer.Tokenize(pb.TokenizeRequest(text=text), None)  # type: ignore[arg-type]
                    for text in ("Hello world", LONG_TEXT)]
        finally:
            servicer.validate.close()

    short, long = asyncio.run(run())
    assert threads[0] == threading.current_thread().name
    assert threads[1].startswith("validate")
    assert list(short.token_ids) == hf("Hello world")["input_ids"] == [19556, 905]
    assert list(long.token_ids) == hf(LONG_TEXT)["input_ids"]
    assert list(long.tokens) == hf.convert_ids_to_tokens(hf(LONG_TEXT)["input_ids"])
    assert long.prompt == LONG_TEXT
