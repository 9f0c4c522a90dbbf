"""Per-request sampling parameters, shared by the router (validation) and the last stage
(sampling). Torch-free on purpose: the router imports this module and must not load torch.

Defaults follow vLLM / the OpenAI API, so a request that sets nothing samples from the
model's plain softmax at temperature 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

from foundation.structured_output import StructuredOutput, StructuredOutputError

# Temperatures below this count as greedy, as in vLLM: dividing logits by a smaller
# temperature only makes the distribution one-hot anyway, and risks overflow in float32.
GREEDY_TEMPERATURE_EPS = 1e-5

# OpenAI's range for presence_penalty and frequency_penalty.
MAX_ABS_OPENAI_PENALTY = 2.0
# OpenAI's limits on logit_bias: a bias in [-100, 100], at most 300 tokens.
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 300

# torch.Generator.manual_seed accepts any integer in this range.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range. `field` names the parameter; the message says
    what the limit is and what was given. Mapped once, at the edge, to INVALID_ARGUMENT/400."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token of one sequence.

    temperature: 0 (anything below GREEDY_TEMPERATURE_EPS) means greedy argmax.
    top_k: keep the k most likely tokens; -1 or 0 turns it off.
    top_p: keep the smallest set of most likely tokens whose probability sums to >= top_p.
    min_p: drop tokens whose probability is below min_p times the most likely token's.
    seed: if set, the draw depends only on (seed, position in the output), not on the batch.
    repetition_penalty: HF/vLLM semantics, over prompt and output tokens: a seen token's
        logit is divided by it when positive and multiplied by it when negative; 1 is off.
    presence_penalty, frequency_penalty: OpenAI semantics, over output tokens only:
        logit -= presence * (count > 0) + frequency * count; 0 is off.
    logprobs: None returns no log-probabilities; k >= 0 returns the sampled token's
        log-probability plus the k most likely alternatives.
    prompt_logprobs: None returns none for the prompt; k >= 0 returns, for every prompt
        token after the first, its log-probability given the tokens before it plus the k
        most likely alternatives at that position (vLLM's `prompt_logprobs`). The last
        stage computes the logits of every prompt position for it, and the router reads
        no cached prefix for the request (a cached position has no logits).
    min_tokens: no id of `banned_until_min` is sampled before this many outputs (vLLM's:
        the router fills that with the EOS ids and the request's stop_token_ids).
    logit_bias: (token id, bias) pairs added to those logits before sampling (OpenAI's;
        log-probabilities stay the model's).
    structured: what the output must be (a JSON schema, a regex, ...): the last stage
        allows only the tokens that keep the output valid, and the end of sequence once it
        is complete; None is unconstrained.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    banned_until_min: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int, max_logprobs: int) -> None:
        """Raise SamplingParamsError for the first field that is out of range.

        Args:
            vocab_size: the model's vocabulary size; bounds top_k.
            max_logprobs: the server's limit on `logprobs`.
        """
        t = self.temperature
        if not (math.isfinite(t) and t >= 0.0):
            _fail("temperature", f"must be a finite number >= 0, got {t}")
        if not (self.top_k in (-1, 0) or 1 <= self.top_k <= vocab_size):
            _fail("top_k", f"must be -1 or 0 (off) or in [1, {vocab_size}], got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            _fail("seed", f"must be in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed}")
        rp = self.repetition_penalty
        if not (math.isfinite(rp) and rp > 0.0):
            _fail("repetition_penalty", f"must be a finite number > 0, got {rp}")
        for name, value in (
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ):
            if not -MAX_ABS_OPENAI_PENALTY <= value <= MAX_ABS_OPENAI_PENALTY:
                limit = MAX_ABS_OPENAI_PENALTY
                _fail(name, f"must be in [{-limit}, {limit}], got {value}")
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            _fail("logprobs", f"must be None or in [0, {max_logprobs}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= max_logprobs:
            _fail("prompt_logprobs",
                  f"must be None or in [0, {max_logprobs}], got {self.prompt_logprobs}")
        if self.min_tokens < 0:
            _fail("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            _fail("logit_bias", f"may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                                f"got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not 0 <= token < vocab_size:
                _fail("logit_bias", f"token {token} is outside the vocabulary [0, {vocab_size})")
            if not (math.isfinite(bias) and abs(bias) <= MAX_ABS_LOGIT_BIAS):
                _fail("logit_bias", f"bias of token {token} must be in "
                                    f"[{-MAX_ABS_LOGIT_BIAS}, {MAX_ABS_LOGIT_BIAS}], got {bias}")
        if self.structured is not None:
            if self.min_tokens:
                # The constraint decides where the output ends; a ban on the end of
                # sequence could leave a complete output no token to take.
                _fail("min_tokens", "min_tokens cannot be combined with structured output")
            try:
                self.structured.validate()
            except StructuredOutputError as e:
                raise SamplingParamsError(e.field, e.message) from None


def seed_int64(seed: int) -> int:
    """`seed` as the signed 64-bit integer equal to it modulo 2**64, which a proto's int64
    carries. A seeded draw depends on its seed modulo 2**64 only, so the two draw alike; and
    a request's seed plus its choice index, or a seed in [2**63, 2**64), stays sendable."""
    bits = seed & ((1 << 64) - 1)
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def _fail(field: str, what: str) -> NoReturn:
    raise SamplingParamsError(field, f"{field} {what}")
