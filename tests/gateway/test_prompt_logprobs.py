"""Prompt log probabilities through the gateway with the official openai client, against HF
transformers on the same prompt: vLLM's `prompt_logprobs` on completions and chat, streamed
and not, and OpenAI's `echo` with `logprobs` (the prompt's tokens first)."""

from __future__ import annotations

from typing import Any

import httpx2 as httpx
import openai
import pytest
import torch

from tests.default_model import hf_model
from tests.gateway.conftest import MODEL

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def hf_scores(ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: row i scores token i + 1."""
    with torch.no_grad():
        return hf_model()(torch.tensor([ids])).logits[0].float().log_softmax(-1)[:-1]


def tokenize(base_url: str, **body: Any) -> list[int]:
    """The token ids Generate uses for a prompt or messages (vLLM's /tokenize)."""
    response = httpx.post(base_url + "/tokenize", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


def check_vllm_format(positions: list[Any], ids: list[int], k: int) -> None:
    """None first, then each position's map holds the prompt token and the k most likely,
    with HF's log probabilities."""
    want = hf_scores(ids)
    assert positions[0] is None and len(positions) == len(ids)
    for i, position in enumerate(positions[1:]):
        token = ids[i + 1]
        assert position[str(token)]["logprob"] == pytest.approx(want[i, token].item(), abs=2e-4)
        top = want[i].topk(k)
        ranked = sorted((v["rank"], v["logprob"]) for v in position.values()
                        if v["rank"] is not None)
        assert [r for r, _ in ranked] == list(range(1, k + 1))
        assert [lp for _, lp in ranked] == pytest.approx(top.values.tolist(), abs=2e-4)
        assert len(position) in (k, k + 1)  # the prompt token, when not among the top k


def test_completion_prompt_logprobs_match_hf(client: openai.OpenAI, base_url: str) -> None:
    ids = tokenize(base_url, prompt=PROMPT)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                      extra_body={"prompt_logprobs": 2})
    check_vllm_format(whole.choices[0].prompt_logprobs, ids, 2)  # type: ignore[attr-defined]
    first = next(iter(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, stream=True,
        extra_body={"prompt_logprobs": 2})))
    assert first.choices[0].prompt_logprobs == whole.choices[0].prompt_logprobs  # type: ignore[attr-defined]


def test_chat_prompt_logprobs_cover_the_rendered_prompt(client: openai.OpenAI,
                                                        base_url: str) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    ids = tokenize(base_url, messages=messages)
    out = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                         max_tokens=1, temperature=0,
                                         extra_body={"prompt_logprobs": 0})
    check_vllm_format(out.prompt_logprobs, list(ids), 0)  # type: ignore[attr-defined]


def test_echo_with_logprobs_puts_the_prompt_tokens_first(client: openai.OpenAI,
                                                         base_url: str) -> None:
    ids = tokenize(base_url, prompt=PROMPT)
    want = hf_scores(ids)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                      logprobs=1)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                       logprobs=1, echo=True)
    choice, lp = echoed.choices[0], echoed.choices[0].logprobs
    assert choice.text == PROMPT + plain.choices[0].text
    assert lp is not None and plain.choices[0].logprobs is not None
    n = len(ids)
    assert lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.tokens is not None and lp.text_offset is not None
    assert len(lp.tokens) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(
        [want[i, t].item() for i, t in enumerate(ids[1:])], abs=2e-4)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:n])
    assert "".join(lp.tokens[:n]) == PROMPT
    # The generated part is the plain request's, its offsets moved past the prompt's text.
    # The same tokens; their log probabilities to fp32 rounding, not bit for bit: the echoed
    # request's first step also scores the prompt's rows, so its matmuls have other shapes
    # (2.7e-7 apart on one CPU build of torch).
    assert lp.tokens[n:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs,
                                                  abs=1e-5)
    assert lp.text_offset[:n] == sorted(lp.text_offset[:n]) and lp.text_offset[0] == 0
    assert lp.text_offset[n:] == [len(PROMPT) + o
                                  for o in plain.choices[0].logprobs.text_offset]  # type: ignore[union-attr]


def test_prompt_logprobs_out_of_range_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                  extra_body={"prompt_logprobs": 21})
    assert "prompt_logprobs" in str(err.value) and "20" in str(err.value)
