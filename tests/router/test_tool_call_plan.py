"""Tool requests on the router without a mesh: what validation makes of tools and
tool_choice (the parser to use, the grammar that forces calls, the field named when
refused), and that the forcing grammar admits exactly the parser's format on the default
model's tokenizer (llguidance walks the tokens of a text the parser reads back)."""

from __future__ import annotations

import json
from dataclasses import replace

import llguidance
import pytest

from foundation.sampling_params import SamplingParams
from foundation.structured_output import ConstraintKind, StructuredOutput
from foundation.tokenizer import ModelTokenizer
from router.requests import ChatMessage, ChatPrompt, RawGenerateRequest, RequestLimits
from router.tool_calls.parsers import ToolCallFormat, parse_text
from router.tool_calls.types import ToolCall, ToolChoice, ToolChoiceMode, ToolSpec
from router.validation import ValidationError, validate_request
from tests.tool_chat_model import write_tool_chat_model

H, L = ToolCallFormat.HERMES, ToolCallFormat.LLAMA3_JSON
LIMITS = RequestLimits(max_model_len=8192, vocab_size=49152)
CITY = json.dumps({"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False})
TOOLS = (ToolSpec("get_weather", "Weather now", CITY), ToolSpec("now"))
ASK = (ChatMessage("user", "Weather in Paris?"),)
REQUIRED = ToolChoice(ToolChoiceMode.REQUIRED)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    return ModelTokenizer.from_dir(write_tool_chat_model(tmp_path_factory.mktemp("m") / "m"))


def _raw(tools: tuple[ToolSpec, ...] = TOOLS, choice: ToolChoice | None = None,
         **changes: object) -> RawGenerateRequest:
    return replace(RawGenerateRequest("r", ChatPrompt(ASK, tools), tool_choice=choice),
                   **changes)


def test_the_choice_decides_parsing_and_forcing(tok: ModelTokenizer) -> None:
    auto = validate_request(_raw(), LIMITS, tok, H)  # tools and no choice: auto
    assert auto.tool_format is H and auto.sampling.structured is None
    none = validate_request(_raw(choice=ToolChoice(ToolChoiceMode.NONE)), LIMITS, tok, H)
    assert none.tool_format is None and none.prompt_token_ids == auto.prompt_token_ids
    forced = validate_request(_raw(choice=REQUIRED), LIMITS, tok, H)
    assert forced.tool_format is H
    assert forced.sampling.structured is not None
    assert forced.sampling.structured.kind is ConstraintKind.GRAMMAR
    plain = validate_request(_raw(tools=()), LIMITS, tok, None)  # no tools, no parser
    assert plain.tool_format is None and len(plain.prompt_token_ids) < \
        len(auto.prompt_token_ids) - 50


@pytest.mark.parametrize(("raw", "parser", "field", "words"), [
    (_raw(), None, "tool_choice", "no tool-call parser"),
    (_raw(choice=ToolChoice(ToolChoiceMode.REQUIRED, "nope")), H, "tool_choice",
     "not one of the request's tools"),
    (_raw(tools=(), choice=REQUIRED), H, "tool_choice", "needs tools"),
    (_raw(choice=REQUIRED, sampling=SamplingParams(
        structured=StructuredOutput(ConstraintKind.JSON_OBJECT))), H, "tool_choice",
     "cannot be combined"),
    (_raw(choice=REQUIRED, sampling=SamplingParams(min_tokens=2)), H, "min_tokens",
     "cannot be combined"),
    (_raw(tools=(ToolSpec("x" * 65),)), H, "tools[0].function.name", "1 to 64"),
    (_raw(tools=(ToolSpec("f", "", "{"),)), H, "tools[0].function.parameters", "not JSON"),
    (_raw(tools=tuple(ToolSpec(f"f{i}") for i in range(129))), H, "tools", "at most 128"),
    (replace(_raw(), prompt=ChatPrompt((ChatMessage("user", "x", (ToolCall("c", "f", "{}"),)),),
                                       TOOLS)), H, "messages[0].tool_calls", "only assistant"),
    (replace(_raw(), prompt=ChatPrompt((ChatMessage("assistant", "", (ToolCall("c", "f", "[]"),)),),
                                       TOOLS)), H, "messages[0].tool_calls[0].function.arguments",
     "JSON object"),
])
def test_bad_tools_name_the_field(tok: ModelTokenizer, raw: RawGenerateRequest,
                                  parser: ToolCallFormat | None, field: str,
                                  words: str) -> None:
    with pytest.raises(ValidationError) as info:
        validate_request(raw, LIMITS, tok, parser)
    assert info.value.field == field and words in info.value.message, info.value.message


@pytest.mark.parametrize(("fmt", "choice", "text", "ok"), [
    (H, REQUIRED, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
                  '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     True),
    (H, REQUIRED, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                  '</tool_call>', False),  # outside the schema
    (H, ToolChoice(ToolChoiceMode.REQUIRED, "now"), '<tool_call>\n{"name": "get_weather", '
                                                    '"arguments": {"city": "Rome"}}\n</tool_call>',
     False),  # not the named function
    (H, REQUIRED, "Sure! " + '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     False),  # text first
    (L, REQUIRED, '{"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": '
                  '{"city": "Paris"}}', True),
])
def test_the_grammar_admits_exactly_the_parsers_format(
        tok: ModelTokenizer, fmt: ToolCallFormat, choice: ToolChoice, text: str,
        ok: bool) -> None:
    req = validate_request(_raw(choice=choice), LIMITS, tok, fmt)
    assert req.sampling.structured is not None
    lltok = llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=tok.vocab_size,
                                   eos_token=list(tok.special.eos_ids))
    matcher = llguidance.LLMatcher(lltok, req.sampling.structured.validate())
    accepted = all(matcher.consume_token(t) for t in tok.encode(text, False)) \
        and matcher.is_accepting()
    assert accepted is ok
    if ok:
        content, calls = parse_text(fmt, text)
        assert content == "" and len(calls) == 2
