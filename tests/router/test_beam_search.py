"""`router.beam_search.BeamSearch` against HF transformers' beam search: the search fed
the default model's fp32 log probabilities (the whole sequence recomputed each step) returns
HF's hypotheses, same token ids in the same order and scores within 1e-5; and its stopping
rules on a toy model; validation of beam search requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import pytest

from foundation.sampling_params import SamplingParams
from router.beam_search import BeamSearch, TopLogprobs, run_beam_search
from router.outputs import (
    ChoiceDelta,
    FailureKind,
    RequestDone,
    RequestFailed,
    StreamItem,
    TokenLogprob,
    Usage,
)
from router.requests import (
    BeamSearchParams,
    EarlyStopping,
    GenerateRequest,
    RawGenerateRequest,
    RequestLimits,
    TokenPrompt,
)
from router.scheduler import FinishReason
from router.validation import ValidationError, validate_request
from tests.default_model import EOS, hf_model
from tests.router.beam_hf import CASES, BeamCase, hf_beams


def _hf_tops(prompt: list[int], beams: Sequence[tuple[int, ...]], k: int
             ) -> list[TopLogprobs]:
    """Each beam's top k next-token log probabilities (fp32 log_softmax of the logits)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt + list(b) for b in beams])  # beams have one length
        logprobs = hf_model()(ids).logits[:, -1].float().log_softmax(-1)
        values, tokens = logprobs.topk(k)
    return [list(zip(t.tolist(), v.tolist(), strict=True))
            for t, v in zip(tokens, values, strict=True)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_search_returns_hf_beams(case: BeamCase) -> None:
    params = BeamSearchParams(case.width, case.length_penalty, case.early_stopping)
    search = BeamSearch(params, case.max_tokens, [EOS])
    while not search.done:
        search.step(_hf_tops(case.prompt, [b.token_ids for b in search.running],
                             search.candidates))
    got = [(list(h.token_ids), h.score) for h in search.best(case.n)]
    want = hf_beams(case)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, score), (_, hf_score) in zip(got, want, strict=True):
        assert score == pytest.approx(hf_score, abs=1e-5)


def _toy(search: BeamSearch, table: dict[tuple[int, ...], TopLogprobs]) -> None:
    while not search.done:
        search.step([table[b.token_ids] for b in search.running])


# A toy model: token 9 ends; from () the best is 1 then 9 (finished early, short).
_TABLE: dict[tuple[int, ...], TopLogprobs] = {
    (): [(1, -0.1), (2, -0.5), (3, -3.0), (9, -4.0)],
    (1,): [(9, -0.1), (4, -1.0), (5, -2.0), (6, -3.0)],
    (2,): [(4, -0.2), (9, -1.5), (5, -2.5), (6, -3.0)],
    (1, 4): [(9, -0.1), (4, -2.0), (5, -2.5), (6, -3.0)],
    (2, 4): [(9, -0.1), (4, -2.0), (5, -2.5), (6, -3.0)],
    (1, 5): [(9, -0.1), (4, -2.0), (5, -2.5), (6, -3.0)],
}


def test_finished_early_stopping_ends_once_width_hypotheses_end() -> None:
    search = BeamSearch(BeamSearchParams(2, 1.0, EarlyStopping.FINISHED), 3, [9])
    _toy(search, _TABLE)
    best = search.best(2)
    assert [h.token_ids for h in best] == [(1, 9), (2, 4, 9)]
    assert best[0].score == pytest.approx(-0.2 / 2) and best[0].ended_by_stop
    assert best[1].score == pytest.approx(-0.8 / 3)


def test_max_tokens_ends_every_beam_with_length() -> None:
    search = BeamSearch(BeamSearchParams(2, 1.0), 1, [9])
    _toy(search, _TABLE)
    assert [(h.token_ids, h.ended_by_stop) for h in search.best(2)] == [((1,), False),
                                                                       ((2,), False)]
    assert search.best(1)[0].score == pytest.approx(-0.1)


class _NoTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("token prompts only")

    def encode_chat(self, messages: Sequence[dict[str, Any]],
                    add_generation_prompt: bool = True) -> list[int]:
        raise AssertionError("token prompts only")


_LIMITS = RequestLimits(max_model_len=256, vocab_size=1000, max_n=8, max_logprobs=10)


def _validate(beam: BeamSearchParams, **changes: Any) -> Any:
    raw = RawGenerateRequest("r", TokenPrompt((1, 2, 3)), max_tokens=8, beam=beam,
                             sampling=SamplingParams(temperature=0.0))
    return validate_request(replace(raw, **changes), _LIMITS, _NoTokenizer())


def test_validation_fills_the_width_and_names_each_refused_field() -> None:
    assert _validate(BeamSearchParams(), n=3).beam == BeamSearchParams(3)
    assert _LIMITS.max_beam_width == 5  # 2 x width log probabilities per step
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"beam": BeamSearchParams(6)}, "beam_search.beam_width", "and 5, got 6"),
        ({"beam": BeamSearchParams(2), "n": 3}, "beam_search.beam_width", "between n (3)"),
        ({"beam": BeamSearchParams(2, float("nan"))}, "beam_search.length_penalty", "finite"),
        ({"beam": BeamSearchParams(2, 3.2e16)}, "beam_search.length_penalty", "[-5, 5]"),
        ({"beam": BeamSearchParams(2, -5.5)}, "beam_search.length_penalty", "got -5.5"),
        ({"sampling": SamplingParams(temperature=1.0)}, "temperature", "1.0"),
        ({"sampling": SamplingParams(temperature=0.0, top_k=5)}, "top_k", "5"),
        ({"sampling": SamplingParams(temperature=0.0, logit_bias=((5, 1.0),))}, "logit_bias",
         "beam search"),
        ({"sampling": SamplingParams(temperature=0.0, logprobs=1)}, "logprobs", "beam search"),
        ({"stop_token_ids": (7,)}, "stop_token_ids", "beam search"),
    ]
    for changes, field, limit in cases:
        with pytest.raises(ValidationError) as bad:
            _validate(changes.pop("beam", BeamSearchParams()), **changes)
        assert bad.value.field == field and limit in bad.value.message, bad.value.message


class _FakeFront:
    """Answers each 1-token request from `_TABLE` (keyed by the tokens after the prompt)."""

    def __init__(self, prompt: tuple[int, ...], abort: bool = False) -> None:
        self.prompt = prompt
        self.abort = abort
        self.requests: list[GenerateRequest] = []

    def submit(self, req: GenerateRequest, traceparent: str = ""
               ) -> AsyncIterator[list[StreamItem]]:
        self.requests.append(req)
        top = tuple(_TABLE[req.prompt_token_ids[len(self.prompt):]])
        logprobs = () if self.abort else (TokenLogprob(top[0][0], top[0][1], top),)
        reason = FinishReason.ABORT if self.abort else FinishReason.LENGTH
        items: list[StreamItem] = [ChoiceDelta(0, "", (top[0][0],), logprobs, reason),
                                   RequestDone(Usage(len(req.prompt_token_ids), 1))]

        async def stream() -> AsyncIterator[list[StreamItem]]:
            yield items
        return stream()


async def _run(front: _FakeFront, req: GenerateRequest) -> list[StreamItem]:
    out: list[StreamItem] = []
    async for items in run_beam_search(front, req, [9], 20,
                                       lambda ids, skip: " ".join(map(str, ids))):
        out += items
    return out


def test_the_driver_asks_one_token_per_beam_and_answers_whole_choices() -> None:
    prompt = (5, 6, 7)
    req = _validate(BeamSearchParams(2, 1.0, EarlyStopping.FINISHED), n=2, max_tokens=3,
                    prompt=TokenPrompt(prompt))
    front = _FakeFront(prompt)
    out = asyncio.run(_run(front, req))
    first = front.requests[0]
    assert first.prompt_token_ids == prompt and first.max_tokens == 1
    assert first.sampling.logprobs == 4 and first.sampling.temperature == 0.0
    assert [r.prompt_token_ids[3:] for r in front.requests] == [(), (1,), (2,), (2, 4),
                                                                (1, 4)]
    assert out[:2] == [
        ChoiceDelta(0, "1", (1, 9), finish_reason=FinishReason.STOP,
                    beam_score=pytest.approx(-0.1)),
        ChoiceDelta(1, "2 4", (2, 4, 9), finish_reason=FinishReason.STOP,
                    beam_score=pytest.approx(-0.8 / 3))]
    assert out[2] == RequestDone(Usage(3, 5))


def test_an_aborted_step_fails_the_search() -> None:
    req = _validate(BeamSearchParams(2), prompt=TokenPrompt((5, 6, 7)))
    out = asyncio.run(_run(_FakeFront((5, 6, 7), abort=True), req))
    assert len(out) == 1 and isinstance(out[0], RequestFailed)
    assert out[0].kind is FailureKind.UNAVAILABLE
