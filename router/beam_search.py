"""Beam search in the front, as HF transformers' `generate(num_beams=W, do_sample=False)`.

`BeamSearch` is the search itself, with no model and no I/O: each step it takes, for every
running beam, the top log probabilities of its next token, and keeps the W best
continuations by summed log probability. A continuation that ends (the end-of-sequence
token, or max_tokens) and ranks among the step's top W is a finished hypothesis, scored
`sum_logprobs / generated_tokens**length_penalty` (the end-of-sequence token counts); the W
best hypotheses are kept. The search stops as HF's does (`EarlyStopping`).

`run_beam_search` drives it through the front: each step one 1-token greedy request per
running beam (the prompt plus the beam's tokens, asking for 2W top log probabilities), all
sent at once. The prefix cache serves the full KV blocks the beams share, so a step computes
each beam's last partial block and its new token; every request frees its blocks when it
ends. docs/ARCHITECTURE.md says why the search runs here and not in the engine core.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from foundation.sampling_params import SamplingParams
from router.outputs import (
    ChoiceDelta,
    FailureKind,
    RequestDone,
    RequestFailed,
    StreamItem,
    Usage,
)
from router.requests import BeamSearchParams, EarlyStopping, GenerateRequest
from router.scheduler import FinishReason

TopLogprobs = Sequence[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class Beam:
    """A running beam: its generated tokens and their summed log probability."""

    token_ids: tuple[int, ...]
    logprob: float


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam. `score`: sum_logprobs / len(token_ids)**length_penalty."""

    token_ids: tuple[int, ...]
    score: float
    ended_by_stop: bool  # its last token is an end-of-sequence token (else max_tokens)


class BeamSearch:
    """The state of one beam search (see the module). Not thread-safe; no I/O.

    width: beams kept per step (W). max_tokens: the most tokens a hypothesis may have.
    stop_ids: the ids that end a hypothesis (the model's end-of-sequence ids).
    """

    def __init__(self, params: BeamSearchParams, max_tokens: int,
                 stop_ids: Sequence[int]) -> None:
        assert params.width is not None and params.width >= 1 and max_tokens >= 1
        self.width = params.width
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.max_tokens = max_tokens
        self.stop_ids = frozenset(stop_ids)
        # HF keeps (1 + end-of-sequence ids) x W candidates, at least 2W, so that W of them
        # can run on even if the top ones all end.
        self.candidates = max(2, 1 + len(self.stop_ids)) * self.width
        self.running: list[Beam] = [Beam((), 0.0)]
        self.finished: list[Hypothesis] = []  # best first, at most W
        self.done = False
        self._improvable = True  # HF's is_early_stop_heuristic_unsatisfied

    def step(self, tops: Sequence[TopLogprobs]) -> None:
        """Advance by one token. `tops[i]`: running beam i's next-token log probabilities,
        most likely first, at least `candidates` of them (fewer only if the vocabulary is
        smaller). Updates `running`, `finished` and `done`."""
        assert not self.done and len(tops) == len(self.running)
        scored = [(beam.logprob + lp, i, token)
                  for i, (beam, top) in enumerate(zip(self.running, tops, strict=True))
                  for token, lp in top[:self.candidates]]
        scored.sort(key=lambda c: -c[0])  # stable: ties keep beam order, then token rank
        scored = scored[:self.candidates]
        length = len(self.running[0].token_ids) + 1
        ends = [token in self.stop_ids or length >= self.max_tokens for _, _, token in scored]
        full = len(self.finished) == self.width
        may_finish = self._improvable and not (full and self.early_stopping
                                               is EarlyStopping.FINISHED)
        if may_finish:
            for rank, (logprob, i, token) in enumerate(scored[:self.width]):
                if ends[rank]:
                    self._add(Hypothesis((*self.running[i].token_ids, token),
                                         logprob / length**self.length_penalty,
                                         token in self.stop_ids))
        self.running = [Beam((*self.running[i].token_ids, token), logprob)
                        for (logprob, i, token), end in zip(scored, ends, strict=True)
                        if not end][:self.width]
        self._improvable = self._improvable and self._may_improve(length)
        full = len(self.finished) == self.width
        self.done = (not self.running or not self._improvable
                     or (full and self.early_stopping is EarlyStopping.FINISHED))

    def best(self, n: int) -> list[Hypothesis]:
        """The n best finished hypotheses, best first (call once `done`)."""
        return self.finished[:n]

    def _add(self, hyp: Hypothesis) -> None:
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score)  # stable: earlier ones win ties
        del self.finished[self.width:]

    def _may_improve(self, length: int) -> bool:
        """HF's early-stop heuristic: could the best running beam still beat the worst
        finished hypothesis (always, while fewer than W are finished)?"""
        if len(self.finished) < self.width or not self.running:
            return True
        if self.early_stopping is EarlyStopping.NEVER and self.length_penalty > 0:
            length = self.max_tokens
        best = self.running[0].logprob / length**self.length_penalty
        return best > self.finished[-1].score


class Submitter(Protocol):
    """What `run_beam_search` needs of a front (`router.frontend.Frontend` is one)."""

    def submit(self, req: GenerateRequest, traceparent: str = ""
               ) -> AsyncIterator[list[StreamItem]]: ...


Decode = Callable[[Sequence[int], bool], str]  # (token ids, skip_special_tokens) -> text


async def run_beam_search(front: Submitter, req: GenerateRequest, stop_ids: Sequence[int],
                          max_logprobs: int, decode: Decode
                          ) -> AsyncIterator[list[StreamItem]]:
    """The stream of a beam search request: one item list with the n best hypotheses (one
    whole delta each, best first, with its score), then the usage; or a `RequestFailed` as
    soon as a step's request fails. `stop_ids`: the model's end-of-sequence ids (unused
    with `ignore_eos`); `max_logprobs`: the most top log probabilities a request may ask
    for. Cancelling the consumer cancels the step's requests, which aborts them and frees
    their KV blocks."""
    assert req.beam is not None
    search = BeamSearch(req.beam, req.max_tokens, () if req.ignore_eos else stop_ids)
    k = min(search.candidates, max_logprobs)
    step = 0
    while not search.done:
        tops = await asyncio.gather(*(
            _next_logprobs(front, req, beam, k, f"{req.request_id}.beam-{step}-{i}")
            for i, beam in enumerate(search.running)))
        failed = next((t for t in tops if isinstance(t, RequestFailed)), None)
        if failed is None and not all(tops):  # a step request was aborted by its own id
            failed = RequestFailed(FailureKind.UNAVAILABLE,
                                   "a beam search step was aborted before it answered")
        if failed is not None:
            yield [failed]
            return
        search.step([t for t in tops if not isinstance(t, RequestFailed)])
        step += 1
    best = search.best(req.n)
    items: list[StreamItem] = [_delta(decode, req, i, hyp) for i, hyp in enumerate(best)]
    items.append(RequestDone(Usage(len(req.prompt_token_ids),
                                   sum(len(h.token_ids) for h in best))))
    yield items


async def _next_logprobs(front: Submitter, req: GenerateRequest, beam: Beam, k: int,
                         request_id: str) -> TopLogprobs | RequestFailed:
    """The top k next-token log probabilities after `beam`, from one 1-token request."""
    one = GenerateRequest(
        request_id=request_id, prompt_token_ids=req.prompt_token_ids + beam.token_ids,
        sampling=SamplingParams(temperature=0.0, logprobs=k), max_tokens=1, stop=(),
        stop_token_ids=(), ignore_eos=True, n=1, priority=req.priority)
    top: TopLogprobs = ()
    async for items in front.submit(one):
        for item in items:
            if isinstance(item, RequestFailed):
                return item
            if isinstance(item, ChoiceDelta) and item.logprobs:
                top = item.logprobs[0].top
    return top


def _delta(decode: Decode, req: GenerateRequest, index: int, hyp: Hypothesis) -> ChoiceDelta:
    """A hypothesis as its choice's only delta: its end-of-sequence token has no text."""
    text_ids = hyp.token_ids[:-1] if hyp.ended_by_stop else hyp.token_ids
    reason = FinishReason.STOP if hyp.ended_by_stop else FinishReason.LENGTH
    return ChoiceDelta(index, decode(text_ids, req.skip_special_tokens), hyp.token_ids,
                       finish_reason=reason, beam_score=hyp.score)
