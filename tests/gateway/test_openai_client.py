"""The gateway as the official `openai` client sees it, sync and async, streamed and not,
against a real 2-stage mesh on the default model."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc
from tests.gateway.conftest import MODEL

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def _counts(usage: object) -> tuple[int, int, int]:
    """Token counts of a usage record. The prefix-cache share (prompt_tokens_details) may
    differ between two runs of one prompt: the second finds the first's blocks cached."""
    return (usage.prompt_tokens, usage.completion_tokens,  # type: ignore[attr-defined]
            usage.total_tokens)  # type: ignore[attr-defined]


def _aclient(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def _chat_stream(client: openai.OpenAI, **kwargs: Any) -> tuple[str, str | None, Any]:
    """(text, finish_reason, usage) collected from a streamed chat completion."""
    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish, usage


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_greedy_chat_streamed_equals_not_streamed(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                           max_tokens=40)
    text, finish, usage = _chat_stream(client, messages=QUESTION, temperature=0,
                                       max_tokens=40, stream_options={"include_usage": True})
    assert whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and _counts(usage) == _counts(whole.usage)


def test_greedy_completion_streamed_equals_not_streamed_async(base_url: str) -> None:
    async def run() -> None:
        async with _aclient(base_url) as client:
            whole = await client.completions.create(model=MODEL, prompt=STORY, temperature=0,
                                                    max_tokens=24)
            text, finish = "", None
            stream = await client.completions.create(model=MODEL, prompt=STORY, temperature=0,
                                                     max_tokens=24, stream=True)
            async for chunk in stream:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            assert len(whole.choices[0].text) > 20
            assert text == whole.choices[0].text
            assert finish == whole.choices[0].finish_reason == "length"
            assert whole.usage.completion_tokens == 24

    asyncio.run(run())


def test_async_chat_stream_with_usage(base_url: str) -> None:
    async def run() -> None:
        async with _aclient(base_url) as client:
            whole = await client.chat.completions.create(model=MODEL, messages=QUESTION,
                                                         temperature=0, max_tokens=20)
            stream = await client.chat.completions.create(
                model=MODEL, messages=QUESTION, temperature=0, max_tokens=20, stream=True,
                stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            assert all(c.usage is None for c in chunks[:-1])
            text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
            assert text == whole.choices[0].message.content
            assert _counts(chunks[-1].usage) == _counts(whole.usage)

    asyncio.run(run())


def test_n3_with_seed_gives_three_indexed_choices_reproducibly(client: openai.OpenAI) -> None:
    def once() -> list[str]:
        r = client.completions.create(model=MODEL, prompt=STORY, n=3, seed=1234,
                                      temperature=1.0, max_tokens=12)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert r.usage.completion_tokens == 36  # 3 x 12, no EOS this early at this seed
        return [c.text for c in r.choices]

    first, second = once(), once()
    assert first == second
    assert len(set(first)) == 3  # each choice draws from its own seed (seed + index)
    streamed = ["", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=STORY, n=3, seed=1234,
                                           temperature=1.0, max_tokens=12, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == first


def test_chat_n3_async_streamed_matches_not_streamed(base_url: str) -> None:
    async def run() -> None:
        async with _aclient(base_url) as client:
            kwargs: dict[str, Any] = dict(model=MODEL, messages=QUESTION, n=3, seed=7,
                                          temperature=0.9, max_tokens=10)
            whole = await client.chat.completions.create(**kwargs)
            assert [c.index for c in whole.choices] == [0, 1, 2]
            texts = ["", "", ""]
            async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                for c in chunk.choices:
                    texts[c.index] += c.delta.content or ""
            assert texts == [c.message.content for c in whole.choices]

    asyncio.run(run())


def test_usage_equals_the_token_ids_received(
        client: openai.OpenAI, stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    received, usage = 0, None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=QUESTION, n=2, seed=3, temperature=0.7, max_tokens=25,
            stream=True, stream_options={"include_usage": True},
            extra_body={"return_token_ids": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            received += len(c.model_extra["token_ids"])
    prompt = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content=QUESTION[0]["content"])])), timeout=10)
    assert usage is not None and received > 0
    assert usage.completion_tokens == received
    assert usage.prompt_tokens == len(prompt.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_usage_of_a_list_of_prompts_sums_every_choice(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=[STORY, "The sea is"], n=2, seed=5,
                                  temperature=0.8, max_tokens=6, logprobs=0,
                                  extra_body={"return_token_ids": True})
    ids = [c.model_extra["token_ids"] for c in r.choices]
    assert r.usage.completion_tokens == sum(len(x) for x in ids)
    assert [len(c.logprobs.tokens) for c in r.choices] == [len(x) for x in ids]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_excluded(client: openai.OpenAI, stream: bool) -> None:
    full = client.completions.create(model=MODEL, prompt=STORY, temperature=0,
                                     max_tokens=30).choices[0].text
    stop = full.split()[3]  # a word well inside the text
    cut = full[:full.index(stop)]
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=STORY, temperature=0, max_tokens=30,
                                  stop=[stop, "\n\n\n"])
    if stream:
        text, finish = "", None
        for chunk in client.completions.create(stream=True, **kwargs):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert text == cut and stop not in text
    assert finish == "stop"


def test_chat_stop_string_is_excluded(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                          max_tokens=30).choices[0].message.content
    assert full
    stop = "Paris" if "Paris" in full else full.split()[2]
    text, finish, _ = _chat_stream(client, messages=QUESTION, temperature=0, max_tokens=30,
                                   stop=stop)
    assert text == full[:full.index(stop)]
    assert finish == "stop"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                       max_tokens=6, logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the sampled token is the likeliest
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.logprob <= 0


def test_completion_logprobs_and_offsets(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=STORY, temperature=0, max_tokens=10,
                                  logprobs=2)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                   strict=True):
        assert len(top) == 2 and top[token] == pytest.approx(logprob)


def test_streamed_logprobs_match_whole(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12,
                                  logprobs=True, top_logprobs=1)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [t for chunk in client.chat.completions.create(stream=True, **kwargs)
                for c in chunk.choices if c.logprobs for t in c.logprobs.content]
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == \
        [(t.token, round(t.logprob, 5)) for t in whole]


def test_token_id_prompts_equal_text_prompts(
        client: openai.OpenAI, stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    ids = list(stub.Tokenize(pb.TokenizeRequest(text=STORY), timeout=10).token_ids)
    by_text = client.completions.create(model=MODEL, prompt=STORY, temperature=0, max_tokens=8)
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8)
    both = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], temperature=0,
                                     max_tokens=8)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == by_text.choices[0].text
    assert both.usage.prompt_tokens == len(ids) + 2


def test_list_of_prompts_lays_out_choices_as_openai(client: openai.OpenAI) -> None:
    """Prompt p's choice i is index p * n + i, and equals what prompt p alone gives."""
    prompts = [STORY, "The sea is"]
    kwargs: dict[str, Any] = dict(model=MODEL, n=2, seed=11, temperature=0.8, max_tokens=6)
    both = client.completions.create(prompt=prompts, **kwargs)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(prompt=prompt, **kwargs)
        assert [c.text for c in both.choices[2 * p:2 * p + 2]] == \
            [c.text for c in alone.choices]


def test_sampling_fields_reach_the_router(client: openai.OpenAI) -> None:
    """max_completion_tokens, top_p, penalties and vLLM's top_k/min_p/repetition_penalty are
    accepted; top_k=1 is greedy whatever the temperature."""
    greedy = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                            max_completion_tokens=12)
    top1 = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=1.5, top_p=0.9, max_completion_tokens=12,
        presence_penalty=0.0, frequency_penalty=0.0, user="test-user",
        extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0})
    assert greedy.usage.completion_tokens <= 12
    assert top1.choices[0].message.content == greedy.choices[0].message.content


def test_client_errors_carry_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=-1)
    assert bad.value.status_code == 400
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    assert "temperature" in bad.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-17", messages=QUESTION)
    assert "gpt-17" in missing.value.message
    with pytest.raises(openai.BadRequestError) as tokens:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10**6)
    assert tokens.value.body["param"] == "max_tokens"  # type: ignore[index]
