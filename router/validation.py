"""Request validation: `RawGenerateRequest` + `RequestLimits` -> `GenerateRequest`.

Every failure raises one `ValidationError(field, message)`; the edges map it once to
INVALID_ARGUMENT / HTTP 400. A message names the field, the limit and what was given.

Limits (vLLM / OpenAI-like; sampling ranges live in `SamplingParams.validate`):
  temperature >= 0 (finite); top_p in (0, 1]; top_k -1 or 0 (off) or in [1, vocab_size];
  min_p in [0, 1]; presence_penalty, frequency_penalty in [-2, 2]; repetition_penalty > 0
  (finite, no upper bound, as vLLM); seed in [-2**63, 2**64 - 1]; logprobs in
  [0, max_logprobs]; max_tokens in [1, max_tokens_cap]; n in [1, max_n]; priority fits int32
  (the gRPC field's type); stop strings non-empty, at most max_stop_sequences of at most
  max_stop_len characters; stop token ids and prompt token ids in [0, vocab_size).
  Beam search: width in [n, min(max_n, max_logprobs // 2)], length_penalty in [-5, 5], every
  sampling field neutral (temperature 0), no stop strings or stop token ids.

Cheap checks run before the prompt is tokenized, so a bad request costs no tokenizer work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NoReturn, Protocol

from foundation.sampling_params import SamplingParams, SamplingParamsError
from foundation.tokenizer import ChatTemplateError
from router.requests import (
    BeamSearchParams,
    ChatMessage,
    ChatPrompt,
    GenerateRequest,
    PromptInput,
    RawGenerateRequest,
    RequestLimits,
    TextPrompt,
    TokenPrompt,
)
from router.tool_calls.parsers import ToolCallFormat
from router.tool_calls.plan import ToolsError, check_tools
from router.tool_requests import apply_tool_choice, template_messages, template_tools

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class ValidationError(ValueError):
    """A request field is out of range. `field` names it (`"messages[2].role"`); the message
    says what the limit is and what was given."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class PromptEncoder(Protocol):
    """What validation needs of a tokenizer (`foundation.tokenizer.ModelTokenizer` is one)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: Sequence[dict[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None) -> list[int]: ...


def validate_request(raw: RawGenerateRequest, limits: RequestLimits,
                     tokenizer: PromptEncoder,
                     tool_parser: ToolCallFormat | None = None) -> GenerateRequest:
    """Check every field of `raw` against `limits`, tokenize its prompt and fit max_tokens.

    Raises:
        ValidationError: for the first field out of range.
    """
    if not raw.request_id:
        _fail("request_id", "request_id must not be empty")
    validate_sampling(raw.sampling, limits)
    try:  # tools and tool_choice: `tool_parser` is the router's --tool-call-parser
        sampling, tool_format = apply_tool_choice(raw, tool_parser)
    except ToolsError as e:
        raise ValidationError(e.field, e.message) from e
    _check_range("n", raw.n, 1, limits.max_n)
    _check_range("priority", raw.priority, _INT32_MIN, _INT32_MAX)
    if raw.max_tokens is not None:
        _check_range("max_tokens", raw.max_tokens, 1, limits.max_tokens_cap)
    validate_stop(raw.stop, limits)
    if len(raw.stop_token_ids) > limits.max_stop_token_ids:
        _fail("stop_token_ids", f"stop_token_ids has {len(raw.stop_token_ids)} ids, "
                                f"at most {limits.max_stop_token_ids} are allowed")
    _check_in_vocab("stop_token_ids", raw.stop_token_ids, limits.vocab_size)
    if raw.truncate_prompt_tokens is not None:
        _check_range("truncate_prompt_tokens", raw.truncate_prompt_tokens, 1,
                     limits.max_model_len - 1)
    beam = None if raw.beam is None else validate_beam(raw, limits)
    prompt_ids = validate_prompt(raw.prompt, limits, tokenizer, raw.truncate_prompt_tokens)
    max_tokens = fit_max_tokens(len(prompt_ids), raw.max_tokens, limits)
    if raw.ignore_eos and raw.sampling.structured is not None:
        _fail("ignore_eos", "ignore_eos cannot be combined with structured output (the "
                            "output ends when the constraint is complete)")
    if raw.sampling.min_tokens > max_tokens:
        _fail("min_tokens", f"min_tokens ({raw.sampling.min_tokens}) must not exceed "
                            f"max_tokens ({max_tokens})")
    return GenerateRequest(
        request_id=raw.request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        max_tokens=max_tokens,
        stop=raw.stop,
        stop_token_ids=raw.stop_token_ids,
        ignore_eos=raw.ignore_eos,
        n=raw.n,
        priority=raw.priority,
        include_stop_str_in_output=raw.include_stop_str_in_output,
        skip_special_tokens=raw.skip_special_tokens,
        beam=beam,
        tool_format=tool_format,
    )


# A hypothesis scores sum_logprobs / len**length_penalty: within this bound the score is
# finite as a float32 (the API's beam_score) for any length up to 2**20 tokens.
MAX_ABS_LENGTH_PENALTY = 5.0

# Sampling fields beam search cannot honour, with their neutral values: the beams are
# ranked by the model's raw log probabilities, which these would not change.
_BEAM_NEUTRAL = (("temperature", 0.0), ("top_p", 1.0), ("min_p", 0.0),
                 ("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                 ("frequency_penalty", 0.0), ("min_tokens", 0), ("logit_bias", ()),
                 ("structured", None), ("logprobs", None), ("prompt_logprobs", None))
_BEAM_FIELD_NAMES = {"structured": "structured_output"}


def validate_beam(raw: RawGenerateRequest, limits: RequestLimits) -> BeamSearchParams:
    """`raw.beam` with its width filled in (n when unset), in [n, max_beam_width]; every
    sampling field at its neutral value and no stop strings or stop token ids (a finished
    hypothesis ends at the model's end-of-sequence token or max_tokens only)."""
    assert raw.beam is not None
    width = raw.n if raw.beam.width is None else raw.beam.width
    top = limits.max_beam_width
    if top < 1:
        _fail("beam_search", f"beam search needs max_logprobs >= 2 on this server "
                             f"(it is {limits.max_logprobs})")
    if not raw.n <= width <= top:
        _fail("beam_search.beam_width", f"beam_search.beam_width must be between n "
                                        f"({raw.n}) and {top}, got {width}")
    if not abs(raw.beam.length_penalty) <= MAX_ABS_LENGTH_PENALTY:  # NaN too
        _fail("beam_search.length_penalty", "beam_search.length_penalty must be a finite "
                                            f"number in [-{MAX_ABS_LENGTH_PENALTY:g}, "
                                            f"{MAX_ABS_LENGTH_PENALTY:g}], got "
                                            f"{raw.beam.length_penalty}")
    for name, neutral in _BEAM_NEUTRAL:
        value = getattr(raw.sampling, name, neutral)
        if value != neutral:
            field = _BEAM_FIELD_NAMES.get(name, name)
            _fail(field, f"{field} cannot be combined with beam search (got {value!r}; "
                         f"beam search ranks the model's own log probabilities)")
    if raw.sampling.top_k not in (-1, 0):
        _fail("top_k", f"top_k cannot be combined with beam search (got {raw.sampling.top_k})")
    for name in ("stop", "stop_token_ids"):
        if getattr(raw, name):
            _fail(name, f"{name} cannot be combined with beam search (a hypothesis ends at "
                        "the end-of-sequence token or max_tokens)")
    return replace(raw.beam, width=width)


def validate_sampling(sampling: SamplingParams, limits: RequestLimits) -> None:
    """`SamplingParams.validate`, with its error turned into a ValidationError."""
    try:
        sampling.validate(limits.vocab_size, limits.max_logprobs)
    except SamplingParamsError as e:
        raise ValidationError(e.field, e.message) from e


def validate_stop(stop: Sequence[str], limits: RequestLimits) -> None:
    """At most max_stop_sequences non-empty strings of at most max_stop_len characters."""
    if len(stop) > limits.max_stop_sequences:
        _fail("stop", f"stop has {len(stop)} sequences, "
                      f"at most {limits.max_stop_sequences} are allowed")
    for i, s in enumerate(stop):
        if not s:
            _fail(f"stop[{i}]", f"stop[{i}] is empty; stop strings must have a character")
        if len(s) > limits.max_stop_len:
            _fail(f"stop[{i}]", f"stop[{i}] is {len(s)} characters, "
                                f"at most {limits.max_stop_len} are allowed")


def validate_prompt(prompt: PromptInput, limits: RequestLimits,
                    tokenizer: PromptEncoder, truncate: int | None = None) -> tuple[int, ...]:
    """The prompt's token ids: non-empty, in the vocabulary, shorter than the context; with
    `truncate`, only the last `truncate` of them (checked in range by the caller).

    Text and message sizes are checked before tokenizing; a chat template that refuses the
    messages (roles out of order, no template) is a ValidationError on `messages`.
    """
    if isinstance(prompt, TokenPrompt):
        field, ids = "prompt_token_ids", prompt.token_ids
        if truncate is not None:
            ids = ids[-truncate:]
        if not ids:
            _fail(field, "prompt_token_ids must not be empty")
        _check_prompt_fits(field, len(ids), limits)  # before scanning a giant list
        _check_in_vocab(field, ids, limits.vocab_size)
        return ids
    if isinstance(prompt, TextPrompt):
        field = "prompt"
        if not prompt.text:
            _fail(field, "prompt must not be empty")
        if len(prompt.text) > limits.max_prompt_chars:
            _fail(field, f"prompt is {len(prompt.text)} characters, "
                         f"at most {limits.max_prompt_chars} are allowed")
        ids = tuple(tokenizer.encode(prompt.text))
    else:
        field = "messages"
        _check_messages(prompt.messages, limits)
        try:
            ids = tuple(_encode_chat(prompt, tokenizer))
        except ChatTemplateError as e:
            raise ValidationError(field, f"messages: {e}") from e
    if truncate is not None:
        ids = ids[-truncate:]
    if not ids:
        _fail(field, "prompt has no tokens")
    _check_prompt_fits(field, len(ids), limits)
    return ids


def validate_token_ids(ids: Sequence[int], limits: RequestLimits) -> tuple[int, ...]:
    """Token ids to detokenize: at most the context's length of them, each in the
    vocabulary (field `token_ids`)."""
    if len(ids) > limits.max_model_len:
        _fail("token_ids", f"token_ids has {len(ids)} ids, at most the model's context of "
                           f"{limits.max_model_len} are allowed")
    _check_in_vocab("token_ids", ids, limits.vocab_size)
    return tuple(ids)


def fit_max_tokens(num_prompt_tokens: int, max_tokens: int | None,
                   limits: RequestLimits) -> int:
    """The request's max_tokens: as given if prompt + max_tokens fits the context, else a
    ValidationError; when not given, the remaining context capped by max_tokens_cap."""
    room = limits.max_model_len - num_prompt_tokens
    if max_tokens is None:
        return min(room, limits.max_tokens_cap)
    if max_tokens > room:
        _fail("max_tokens",
              f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
              f"{num_prompt_tokens + max_tokens} exceeds the model's context of "
              f"{limits.max_model_len}")
    return max_tokens


def _check_messages(messages: Sequence[ChatMessage], limits: RequestLimits) -> None:
    if not messages:
        _fail("messages", "messages must not be empty")
    roles = limits.allowed_roles
    chars = 0
    for i, m in enumerate(messages):
        if m.role not in roles:
            _fail(f"messages[{i}].role",
                  f"messages[{i}].role {m.role!r} is not one of {', '.join(roles)}")
        chars += len(m.content) + sum(len(c.arguments) for c in m.tool_calls)
    if chars > limits.max_prompt_chars:
        _fail("messages", f"messages have {chars} characters of content, "
                          f"at most {limits.max_prompt_chars} are allowed")


def _encode_chat(prompt: ChatPrompt, tokenizer: PromptEncoder) -> list[int]:
    """The messages (and tools, when given) through the chat template."""
    try:
        messages = template_messages(prompt.messages)
    except ToolsError as e:
        raise ValidationError(e.field, e.message) from e
    if not prompt.tools:
        return tokenizer.encode_chat(messages)
    try:
        check_tools(prompt.tools)
    except ToolsError as e:
        raise ValidationError(e.field, e.message) from e
    return tokenizer.encode_chat(messages, tools=template_tools(prompt.tools))


def _check_prompt_fits(field: str, num_tokens: int, limits: RequestLimits) -> None:
    """At least one token of room must stay for the output."""
    context = limits.max_model_len
    if num_tokens > context:
        _fail(field, f"prompt has {num_tokens} tokens, more than the model's context "
                     f"of {context}")
    if num_tokens == context:
        _fail(field, f"prompt has {num_tokens} tokens, which fills the model's context "
                     f"of {context} and leaves no room to generate")


def _check_in_vocab(name: str, ids: Sequence[int], vocab: int) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            _fail(f"{name}[{i}]", f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab})")


def _check_range(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        _fail(name, f"{name} must be between {lo} and {hi}, got {value}")


def _fail(field: str, message: str) -> NoReturn:
    raise ValidationError(field, message)
