"""OpenAI request bodies -> `GenerationSpec`: what to ask the router, and how to answer.

Field types are checked here (`gateway.fields`); value ranges are left to the router, which
names the field and the limit. Features the router cannot honour (suffix, best_of > n)
are refused with 400 rather than ignored; structured output (`response_format`, vLLM's
`guided_*`) is read by `gateway.structured`, tool calling (`tools`, `tool_choice`, tool
messages) by `gateway.tools`. vLLM's beam search (`use_beam_search`, where best_of may
exceed n) is read by `_beam_search`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from gateway.errors import invalid
from gateway.fields import INT64, Fields, check_text, wrong_type
from gateway.structured import structured_output
from gateway.tools import message_tool_fields, tool_options

# OpenAI's legacy /v1/completions default; chat defaults to "what fits" (the router's).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_SAMPLING = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty")
# OpenAI renamed "system" to "developer" for newer models; the chat templates know "system".
_ROLE_ALIASES = {"developer": "system"}
# OpenAI fields that change nothing a model computes: accepted and ignored. Any other field
# the parsers do not read is refused with 400 naming it.
IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier", "prompt_cache_key",
                            "safety_identifier"})


class Endpoint(Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(frozen=True)
class Prompt:
    """One prompt: exactly one of text, token ids or chat messages is set."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None


@dataclass(frozen=True)
class GenerationSpec:
    """A parsed request. `options` are keyword arguments for `router.client.build_request`
    (sampling, max_tokens, stop, n, logprobs, ...); `logprobs` is the router's value (the
    number of alternatives per token, None = none); `max_tokens_field` is the name the
    client used for the output limit, for error messages."""

    endpoint: Endpoint
    model: str | None
    prompts: tuple[Prompt, ...]
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None
    return_token_ids: bool
    user: str | None
    max_tokens_field: str
    options: dict[str, Any]
    echo: bool = False  # completions: each choice's text starts with its prompt's
    # vLLM's prompt_logprobs: alternatives per prompt position (None = none asked); with
    # echo and logprobs the router is asked for them too (`options`), to put the prompt's
    # tokens first in each choice's logprobs.
    prompt_logprobs: int | None = None
    structured_field: str | None = None  # the field that constrained the output, if any


def parse_completions(body: dict[str, Any], max_prompts: int) -> GenerationSpec:
    f = Fields(body)
    _refuse_unsupported(f, suffix="")
    echo = bool(f.boolean("echo"))
    n = f.integer("n")
    beam = _beam_search(f, n)
    logprobs = f.integer("logprobs")
    max_tokens = f.integer("max_tokens")
    options = _common_options(f)
    prompt_logprobs = options["prompt_logprobs"]
    if echo and logprobs is not None and logprobs >= 0:  # the prompt's tokens come first
        options["prompt_logprobs"] = max(logprobs, prompt_logprobs or 0)
    options["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    options["beam_search"] = beam
    spec = _spec(f, Endpoint.COMPLETIONS, parse_prompts(f.raw("prompt"), max_prompts), n,
                 logprobs, "max_tokens", options)
    spec = _with_structured_output(f, spec)
    f.refuse_unknown(IGNORED_FIELDS)
    return replace(spec, echo=echo, prompt_logprobs=prompt_logprobs)


def parse_chat(body: dict[str, Any]) -> GenerationSpec:
    f = Fields(body)
    messages = parse_messages(f.array("messages"))
    logprobs = None
    top = f.integer("top_logprobs")
    if f.boolean("logprobs"):
        logprobs = 0 if top is None else top
    elif top is not None:
        raise invalid("top_logprobs", "top_logprobs needs logprobs set to true")
    options = {**_common_options(f), **tool_options(f)}
    field = "max_completion_tokens" if f.raw("max_completion_tokens") is not None \
        else "max_tokens"
    options["beam_search"] = _beam_search(f, f.integer("n"))
    options["max_tokens"] = f.integer(field)
    f.raw("max_tokens")  # read: with max_completion_tokens set, max_tokens is ignored
    spec = _spec(f, Endpoint.CHAT, (Prompt(messages=messages),), f.integer("n"), logprobs,
                 field, options)
    spec = _with_structured_output(f, spec)
    f.refuse_unknown(IGNORED_FIELDS)
    return replace(spec, prompt_logprobs=options["prompt_logprobs"])


def _spec(f: Fields, endpoint: Endpoint, prompts: tuple[Prompt, ...], n: int | None,
          logprobs: int | None, max_tokens_field: str, options: dict[str, Any]
          ) -> GenerationSpec:
    stream = bool(f.boolean("stream"))
    stream_options = f.obj("stream_options")
    if stream_options is not None and not stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    include_usage = bool(stream_options and stream_options.boolean("include_usage"))
    # vLLM's: usage so far on every chunk; only with include_usage, as vLLM reads it
    continuous = bool(stream_options and stream_options.boolean("continuous_usage_stats"))
    continuous &= include_usage
    if stream_options is not None:
        stream_options.refuse_unknown()
    options.update(n=n, logprobs=logprobs)
    return GenerationSpec(
        endpoint=endpoint, model=f.string("model"), prompts=prompts, n=1 if n is None else n,
        stream=stream, include_usage=include_usage, continuous_usage=continuous,
        logprobs=logprobs,
        return_token_ids=bool(f.boolean("return_token_ids")), user=f.string("user"),
        max_tokens_field=max_tokens_field, options=options)


def _common_options(f: Fields) -> dict[str, Any]:
    """The build_request arguments both endpoints share (vLLM's extensions included)."""
    options: dict[str, Any] = {key: f.number(key) for key in _SAMPLING}
    options["top_k"] = f.integer("top_k")
    options["seed"] = f.integer("seed", INT64)
    options["stop"] = f.strings("stop") or ()
    options["stop_token_ids"] = f.integers("stop_token_ids") or ()
    options["ignore_eos"] = bool(f.boolean("ignore_eos"))
    options["priority"] = f.integer("priority") or 0
    options["include_stop_str_in_output"] = bool(f.boolean("include_stop_str_in_output"))
    options["skip_special_tokens"] = f.boolean("skip_special_tokens")
    options["truncate_prompt_tokens"] = f.integer("truncate_prompt_tokens")
    options["prompt_logprobs"] = f.integer("prompt_logprobs")  # the router checks the range
    options["min_tokens"] = f.integer("min_tokens")
    options["logit_bias"] = _logit_bias(f)
    return options


def _beam_search(f: Fields, n: int | None) -> dict[str, Any] | None:
    """vLLM's beam search fields: with `use_beam_search`, `build_request`'s `beam_search`
    argument (beam_width = best_of; unset: the router's default, n); without it best_of
    must equal n and length_penalty / early_stopping are refused (they would change
    nothing)."""
    best_of = f.integer("best_of")
    length_penalty = f.number("length_penalty")
    early_stopping = f.raw("early_stopping")
    if not f.boolean("use_beam_search"):
        if best_of is not None and best_of != (n or 1):
            raise invalid("best_of", f"best_of must equal n ({n or 1}) or be unset without "
                                     f"use_beam_search; ranking {best_of} sampled candidates "
                                     "is not supported")
        for key, value in (("length_penalty", length_penalty),
                           ("early_stopping", early_stopping)):
            if value is not None:
                raise invalid(key, f"{key} applies to beam search only; set use_beam_search")
        return None
    if early_stopping not in (None, True, False, "never"):
        raise invalid("early_stopping", "early_stopping must be true, false or \"never\", "
                                        f"got {early_stopping!r}")
    return {"beam_width": best_of, "length_penalty": length_penalty,
            "early_stopping": early_stopping}


def _with_structured_output(f: Fields, spec: GenerationSpec) -> GenerationSpec:
    """`spec` with the request's structured output constraint, if any."""
    found = structured_output(f)
    if found is None:
        return spec
    field, constraint = found
    return replace(spec, options={**spec.options, "structured_output": constraint},
                   structured_field=field)


def _logit_bias(f: Fields) -> dict[int, float] | None:
    """OpenAI's logit_bias: an object of token id (a decimal string) -> bias."""
    value = f.obj("logit_bias")
    if value is None:
        return None
    out = {}
    for key in value.body:
        if not key.lstrip("-").isdigit():
            raise invalid("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        bias = value.number(key)
        if bias is None:
            raise wrong_type(f"logit_bias.{key}", "a number", None)
        out[int(key)] = bias
    return out


def _refuse_unsupported(f: Fields, **defaults: Any) -> None:
    """Fields OpenAI defines that the router cannot honour: accepted only at their default."""
    for key, default in defaults.items():
        value = f.raw(key)
        if value is not None and value != default:
            raise invalid(key, f"{key} is not supported by this server (got {value!r})")


def parse_prompts(value: Any, max_prompts: int) -> tuple[Prompt, ...]:
    """OpenAI's `prompt`: a string, an array of strings, an array of token ids, or an array
    of arrays of token ids. Each entry of an array of prompts gets its own choices."""
    if isinstance(value, str):
        return (Prompt(text=check_text("prompt", value)),)
    if not isinstance(value, list):
        raise wrong_type("prompt", "a string, an array of strings or an array of token ids",
                         value)
    if not value:
        raise invalid("prompt", "prompt must not be empty")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return (Prompt(token_ids=_token_ids("prompt", value)),)
    if len(value) > max_prompts:
        raise invalid("prompt", f"prompt has {len(value)} prompts, at most {max_prompts} "
                                "are allowed per request")
    prompts = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            prompts.append(Prompt(text=check_text(f"prompt[{i}]", item)))
        elif isinstance(item, list):
            prompts.append(Prompt(token_ids=_token_ids(f"prompt[{i}]", item)))
        else:
            raise wrong_type(f"prompt[{i}]", "a string or an array of token ids", item)
    return tuple(prompts)


def _token_ids(name: str, values: list[Any]) -> tuple[int, ...]:
    for j, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise wrong_type(f"{name}[{j}]", "an integer token id", v)
        if not -(1 << 63) <= v < (1 << 63):
            raise invalid(f"{name}[{j}]", f"{name}[{j}] = {v} is not a token id")
    return tuple(values)


def parse_messages(value: list[Any] | None) -> tuple[dict[str, Any], ...]:
    """Chat messages with string content, or content as an array of text parts (joined with
    newlines), with their tool fields (`gateway.tools`). Roles are checked by the router
    against the chat template's."""
    if value is None:
        raise invalid("messages", "messages is required")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise wrong_type(f"messages[{i}]", "an object", item)
        m = Fields(item, f"messages[{i}].")
        role = m.string("role")
        if role is None:
            raise invalid(f"messages[{i}].role", f"messages[{i}].role is required")
        role = _ROLE_ALIASES.get(role, role)
        out.append({"role": role,
                    "content": _content(f"messages[{i}].content", m.raw("content")),
                    **message_tool_fields(m, role, f"messages[{i}]")})
    return tuple(out)


def _content(name: str, value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return check_text(name, value)
    if not isinstance(value, list):
        raise wrong_type(name, "a string or an array of content parts", value)
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict):
            raise wrong_type(f"{name}[{j}]", "an object", part)
        p = Fields(part, f"{name}[{j}].")
        if p.string("type") != "text":
            raise invalid(f"{name}[{j}].type", f"{name}[{j}].type must be 'text'; only text "
                                               "content is supported")
        text = p.string("text")
        if text is None:
            raise invalid(f"{name}[{j}].text", f"{name}[{j}].text is required")
        texts.append(text)
    return "\n".join(texts)
