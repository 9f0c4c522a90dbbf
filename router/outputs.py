"""What a request's stream carries back to the edge (domain objects; no protos)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from router.requests import FinishReason


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


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class RequestDone:
    """The last item of a request's stream when it completed (every choice finished)."""

    usage: Usage


class FailureKind(Enum):
    UNAVAILABLE = "unavailable"  # a stage down past the recovery budget, or draining
    INTERNAL = "internal"


@dataclass(frozen=True)
class RequestFailed:
    """The last item of a request's stream when the server could not complete it."""

    kind: FailureKind
    message: str


StreamItem = ChoiceDelta | RequestDone | RequestFailed
