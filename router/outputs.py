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
    message for several tokens instead of one per token). Order is kept."""
    out: list[StreamItem] = []
    for item in items:
        prev = out[-1] if out else None
        if isinstance(item, ChoiceDelta) and isinstance(prev, ChoiceDelta) \
                and prev.index == item.index and prev.finish_reason is None:
            out[-1] = replace(item, text=prev.text + item.text,
                              token_ids=prev.token_ids + item.token_ids,
                              logprobs=prev.logprobs + item.logprobs,
                              tool_calls=prev.tool_calls + item.tool_calls)
        else:
            out.append(item)
    return out
