"""The tool-call parsers on fixed texts (a tiny model does not call tools by itself): hermes
and llama3_json, whole and streamed with the text split at every boundary (one and two
cuts), malformed or cut-off calls left as text, several calls, and the format `auto` picks
from a chat template."""

from __future__ import annotations

import itertools
import json

import pytest

from router.tool_calls.parsers import (
    ToolCallFormat,
    new_parser,
    parse_text,
    resolve_format,
)
from router.tool_calls.types import ToolCall

H, L = ToolCallFormat.HERMES, ToolCallFormat.LLAMA3_JSON
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'

# (format, output text, expected content, expected calls as (name, arguments object))
CASES = [
    (H, "The answer is 4.", "The answer is 4.", []),
    (H, "Trailing space and newline \n", "Trailing space and newline \n", []),
    (H, f"<tool_call>\n{WEATHER}\n</tool_call>", "",
     [("get_weather", {"city": "Paris", "days": 2})]),
    (H, f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n", "Let me check.",
     [("get_weather", {"city": "Paris", "days": 2})]),
    (H, f'<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{{"name": "now", "arguments": '
        '{}}\n</tool_call>', "",
     [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]),
    (H, '<tool_call>{"name": "now"}</tool_call>', "", [("now", {})]),  # no arguments
    (H, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "",
     [("f", {"a": 1})]),  # arguments as JSON text
    (H, "x <tool_call>{not json}</tool_call> y", "x <tool_call>{not json}</tool_call> y", []),
    (H, 'a <tool_call>{"arguments": {}}</tool_call>', 'a <tool_call>{"arguments": {}}'
                                                      '</tool_call>', []),  # no name
    (H, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    (H, '<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),  # cut
    (H, f"<tool_call>\n{WEATHER}\n", "", [("get_weather", {"city": "Paris", "days": 2})]),
    (H, "text <tool_ca", "text <tool_ca", []),  # a tag's start, never finished
    (H, f'<tool_call>{WEATHER}</tool_call> then <tool_call>oops</tool_call>',
     " then <tool_call>oops</tool_call>", [("get_weather", {"city": "Paris", "days": 2})]),
    (L, "Paris is sunny.", "Paris is sunny.", []),
    (L, '{"name": "get_weather", "parameters": {"city": "Rome"}}', "",
     [("get_weather", {"city": "Rome"})]),
    (L, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}',
     "", [("a", {}), ("b", {"x": 1})]),
    (L, ' {"x": 1}', ' {"x": 1}', []),  # JSON, but not a call
    (L, '{"name": "a", "parameters": {"q": "unterminated', '{"name": "a", "parameters": '
                                                          '{"q": "unterminated', []),
    (L, '{"name": "a", "parameters": {}} and then text', " and then text", [("a", {})]),
    (L, "<|python", "<|python", []),
    (L, "<not a tag", "<not a tag", []),
]


def _calls(calls: list[ToolCall]) -> list[tuple[str, object]]:
    for call in calls:
        assert call.id.startswith("call_") and len(call.id) == 29
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_text(fmt: ToolCallFormat, text: str, content: str,
                    calls: list[tuple[str, object]]) -> None:
    got_content, got_calls = parse_text(fmt, text)
    assert got_content == content
    assert _calls(got_calls) == calls


def _streamed(fmt: ToolCallFormat, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    parser = new_parser(fmt)
    content, calls = "", []
    for piece in pieces:
        text, more = parser.feed(piece)
        content += text
        calls += more
    text, more = parser.finish()
    return content + text, calls + more


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_streamed_at_every_split(fmt: ToolCallFormat, text: str, content: str,
                                 calls: list[tuple[str, object]]) -> None:
    for a, b in itertools.combinations(range(len(text) + 1), 2):
        pieces = [text[:a], text[a:b], text[b:]]
        got_content, got_calls = _streamed(fmt, pieces)
        assert (got_content, _calls(got_calls)) == (content, calls), pieces
    one_by_one = _streamed(fmt, list(text))
    assert (one_by_one[0], _calls(one_by_one[1])) == (content, calls)


def test_calls_come_out_as_soon_as_they_close_and_text_is_not_held_longer() -> None:
    parser = new_parser(H)
    assert parser.feed("Sure. ") == ("Sure.", [])  # the space waits: a call may follow
    assert parser.feed("<tool_call>\n{\"name\": \"now\", ") == ("", [])
    text, calls = parser.feed('"arguments": {}}\n</tool_call>')
    assert text == "" and [c.name for c in calls] == ["now"]
    assert parser.feed(" more") == (" more", [])
    assert parser.finish() == ("", [])


def test_auto_picks_the_format_from_the_chat_template() -> None:
    assert resolve_format("auto", "... <tool_call>\n{{ tool }} ...") is H
    assert resolve_format("auto", "<|start_header_id|>ipython<|end_header_id|>") is L
    assert resolve_format("auto", "{{ '<|python_tag|>' }}") is L
    assert resolve_format("auto", "{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert resolve_format("auto", None) is None
    assert resolve_format("hermes", None) is H
    assert resolve_format("llama3_json", "<tool_call>") is L
    assert resolve_format("none", "<tool_call>") is None


# A stop string makes the choice decode each token as it comes; with none it holds them and
# decodes them in batches (here every 5 tokens, as at --stream-interval 5).
@pytest.mark.parametrize("stop", [("\x00",), ()], ids=["decoded-per-token", "held"])
def test_a_choice_turns_its_tokens_into_content_and_call_pieces(stop: tuple[str, ...]) -> None:
    """ChoiceState with a parser, fed the default model's tokens one at a time: the text of
    the calls leaves the content, each call comes as its two pieces, and the finish says
    tool_calls."""
    from foundation.tokenizer import ModelTokenizer
    from router.choice import ChoiceState
    from router.outputs import ChoiceDelta, coalesce
    from router.scheduler import FinishReason
    from tests.default_model import default_model_dir

    tok = ModelTokenizer.from_dir(default_model_dir())
    text = f'Checking.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{{"name": "now"}}' \
           '\n</tool_call>'
    ids = [*tok.encode(text, False), tok.special.eos_ids[0]]  # EOS: STOP, no text
    choice = ChoiceState(0, 1, tok.tokenizer, (1,), stop, False, True,
                         tool_parser=new_parser(H))
    assert choice.holds == (not stop)
    deltas: list[ChoiceDelta] = []
    for k, token in enumerate(ids):
        last = k == len(ids) - 1
        delta = choice.on_token(token, None, FinishReason.STOP if last else None)
        if delta is None and k % 5 == 4:
            delta = choice.take_held()
        if delta is not None:
            deltas.append(delta)
    (whole,) = coalesce(deltas)
    assert isinstance(whole, ChoiceDelta) and whole.token_ids == tuple(ids)
    assert whole.text == "Checking." and whole.called_tools
    pieces = whole.tool_calls
    assert [(p.index, bool(p.id), p.name) for p in pieces] == [
        (0, True, "get_weather"), (0, False, ""), (1, True, "now"), (1, False, "")]
    assert json.loads(pieces[1].arguments) == {"city": "Paris", "days": 2}
    assert json.loads(pieces[3].arguments) == {}
