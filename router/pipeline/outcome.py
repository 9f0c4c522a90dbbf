"""What a step's answer from the last stage means to the engine."""

from __future__ import annotations

from dataclasses import dataclass

from router.outputs import TokenLogprob


@dataclass(frozen=True, slots=True)
class PromptScores:
    """Prompt log probabilities of one sequence from one step: `entries[i]` scores the
    prompt token at position `start + i` (>= 1)."""

    seq_id: int
    start: int
    entries: tuple[TokenLogprob, ...]


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """The last stage's answer to one plan.

    tokens: seq_id -> the token sampled for it, for exactly the plan's sampling sequences.
    logprobs: seq_id -> its log-probability record (meaningful only for sequences whose
        sampling settings asked for logprobs).
    prompt: the prompt log probabilities the step computed, for sequences that asked.
    """

    step_id: int
    tokens: dict[int, int]
    logprobs: dict[int, TokenLogprob]
    prompt: tuple[PromptScores, ...] = ()
