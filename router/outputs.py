"""What a request's stream carries back to the edge (domain objects; no protos)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

from router.scheduler import FinishReason
from router.tool_calls.types import ToolCallDelta


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class ChoiceDelta:
    """New output of one choice since its previous delta."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    # With finish_reason STOP: the stop string or the stop token id (one of the request's
    # stop_token_ids) that ended the choice; None for the model's EOS (vLLM's stop_reason).
    stop_reason: str | int | None = None
    # Pieces of tool calls parsed from the output since the previous delta (their text is
    # not in `text`; `router.tool_calls`).
    tool_calls: tuple[ToolCallDelta, ...] = ()
    # On a choice's last delta: it ended with STOP having made tool calls (the edges say
    # finish reason tool_calls).
    called_tools: bool = False
    # With beam search: the hypothesis's score (`router.beam_search`); None otherwise.
    beam_score: float | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class RequestDone:
    """The last item of a request's stream when it completed (every choice finished)."""

    usage: Usage
    timing: RequestTiming | None = None


@dataclass(frozen=True)
class RequestTiming:
    """Where a request's time went, in seconds: queued (arrival at the front to its first
    prefill chunk planned by the engine core), prefill (that to its first token back at the
    front), decode (first token to the last)."""

    queue_s: float
    prefill_s: float
    decode_s: float


class FailureKind(Enum):
    """Why the server ended a request; each maps to one status at the edge."""

    UNAVAILABLE = "unavailable"  # a stage down past the recovery budget, or stopping
    RESOURCE_EXHAUSTED = "resource_exhausted"  # the core's queue is full: retry later
    INVALID_ARGUMENT = "invalid_argument"  # the core can never run it as given
    ALREADY_EXISTS = "already_exists"  # its request_id is live (on any front)
    INTERNAL = "internal"


@dataclass(frozen=True)
class RequestFailed:
    """The last item of a request's stream when the server could not complete it."""

    kind: FailureKind
    message: str


@dataclass(frozen=True)
class PromptLogprobs:
    """A request's prompt log probabilities (it asked for them): entries[i] scores prompt
    token i + 1 given the tokens before it. Comes before the request's first delta."""

    entries: tuple[TokenLogprob, ...]


StreamItem = ChoiceDelta | PromptLogprobs | RequestDone | RequestFailed


def coalesce(items: Sequence[StreamItem]) -> list[StreamItem]:
    """Merge consecutive deltas of the same choice (a consumer that fell behind sends one
    message for several tokens instead of one per token). Order is kept.

    A run is a choice's consecutive deltas up to and including one with a finish reason; it
    becomes its last delta with the run's text, token ids, logprobs and tool calls joined,
    built once per run (a consumer far behind has hundreds of deltas queued)."""
    out: list[StreamItem] = []
    run: list[ChoiceDelta] = []

    def close_run() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append(replace(
                run[-1], text="".join(d.text for d in run),
                token_ids=tuple(t for d in run for t in d.token_ids),
                logprobs=tuple(lp for d in run for lp in d.logprobs),
                tool_calls=tuple(c for d in run for c in d.tool_calls)))
        run.clear()

    for item in items:
        if isinstance(item, ChoiceDelta):
            if run and (run[-1].index != item.index or run[-1].finish_reason is not None):
                close_run()
            run.append(item)
        else:
            close_run()
            out.append(item)
    close_run()
    return out
