"""Tool calls found in a choice's output text, as it streams.

Two formats, as vLLM's `--tool-call-parser` names them:

- `hermes` (Hermes, Qwen2.5, Qwen3): each call is `<tool_call>` JSON `</tool_call>`, the JSON
  `{"name": ..., "arguments": {...}}`; text outside the blocks is the answer's content.
- `llama3_json` (Llama 3.1-3.3): the output is only calls, optionally after
  `<|python_tag|>`: JSON objects `{"name": ..., "parameters": {...}}` (or "arguments")
  separated by `;`.

A parser is fed the choice's text deltas and returns the content to stream now and the calls
completed so far. Contract: text that may still turn out to be part of a call is withheld
(from the start of a `<tool_call>` tag, or the whole llama3 output once it starts like a
call); a call is returned whole once its block (hermes) or JSON object (llama3) closes;
whatever does not parse as a call (malformed or cut-off JSON, a missing name) is released as
content unchanged. An output without calls comes out exactly as it went in. `finish()`
releases what is still withheld when the choice ends: an unclosed last hermes block whose
JSON is whole is still a call, as in vLLM. Whitespace next to calls is dropped.
Parsing a whole text is feeding it once and finishing (`parse_text`), so streamed and whole
results agree wherever the text is split.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from enum import StrEnum
from typing import Any

from router.tool_calls.types import ToolCall, new_call_id

PYTHON_TAG = "<|python_tag|>"


class ToolCallFormat(StrEnum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


# The router's --tool-call-parser choices: a format, "auto" (from the chat template) or none.
PARSER_CHOICES = ("auto", "none", *(f.value for f in ToolCallFormat))


def resolve_format(flag: str, chat_template: str | None) -> ToolCallFormat | None:
    """The format `--tool-call-parser flag` means for a model with this chat template: auto
    picks hermes for a template that writes `<tool_call>`, llama3_json for one that knows
    `<|python_tag|>` or the `ipython` role, else none (None: calls are not parsed)."""
    if flag == "none":
        return None
    if flag != "auto":
        return ToolCallFormat(flag)
    text = chat_template or ""
    if "<tool_call>" in text:
        return ToolCallFormat.HERMES
    if PYTHON_TAG in text or "ipython" in text:
        return ToolCallFormat.LLAMA3_JSON
    return None


def _call_from(obj: Any, keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded JSON object with a string "name" and an object of arguments
    under one of `keys` (absent: no arguments; JSON text of an object is read too)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    found = [k for k in keys if k in obj]
    args: Any = obj[found[0]] if found else {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser(ABC):
    """One choice's parser (see the module's contract)."""

    def __init__(self) -> None:
        self.calls = 0  # calls returned so far

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to stream now, calls completed by this text)."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ToolCall]]:
        """(what was withheld, as content, calls it completes) when the choice ends."""


class HermesParser(ToolCallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # withheld: trailing whitespace, a tag's start, or an open block
        self._inside = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._inside:
                start = self._buf.find(self.OPEN)
                if start < 0:
                    keep = len(self._buf) - self._withheld(self._buf)
                    content.append(self._buf[:keep])
                    self._buf = self._buf[keep:]
                    return "".join(content), calls
                head = self._buf[:start]
                body = head.rstrip()
                content.append(body)
                self._buf = self._buf[len(body):]  # the block keeps the whitespace before it
                self._inside = True
            end = self._buf.find(self.CLOSE)
            if end < 0:
                return "".join(content), calls
            stop = end + len(self.CLOSE)
            block, self._buf = self._buf[:stop], self._buf[stop:]
            self._inside = False
            self._settle(block, block.lstrip()[len(self.OPEN):-len(self.CLOSE)], content, calls)

    def _withheld(self, text: str) -> int:
        """Characters at the end of `text` held back outside a block: trailing whitespace
        (dropped if a call follows), or the start of an opening tag."""
        partial = _partial_tag(text, self.OPEN)
        if partial:
            return partial + len(text[:-partial]) - len(text[:-partial].rstrip())
        return len(text) - len(text.rstrip())

    def _settle(self, block: str, inner: str, content: list[str],
                calls: list[ToolCall]) -> None:
        call = self._decode(inner)
        if call is None:
            content.append(block)
        else:
            calls.append(call)
            self.calls += 1

    @staticmethod
    def _decode(inner: str) -> ToolCall | None:
        try:
            return _call_from(json.loads(inner), ("arguments", "parameters"))
        except json.JSONDecodeError:
            return None

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        content: list[str] = []
        calls: list[ToolCall] = []
        if self._inside:
            self._inside = False
            self._settle(rest, rest.lstrip()[len(self.OPEN):], content, calls)
        else:
            content.append(rest)
        text = "".join(content)
        return ("" if self.calls and not text.strip() else text), calls


class Llama3JsonParser(ToolCallParser):
    """Calls only when the output starts (after whitespace) with `<|python_tag|>` or `{`;
    any other output is content, streamed as it comes. Once calls have been returned, text
    after the last one that is not a call is content; with none, the whole output is."""

    def __init__(self) -> None:
        super().__init__()
        self._mode: str | None = None  # None: undecided; "text" or "calls"
        self._held = ""  # the output as it came, while undecided or in calls mode
        self._rest = ""  # calls mode: the text after the tag, or after the last call
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._mode == "text":
            return text, []
        self._held += text
        if self._mode == "calls":
            self._rest += text
            return "", self._take_calls()
        head = self._held.lstrip()
        if not head or (len(head) < len(PYTHON_TAG) and PYTHON_TAG.startswith(head)):
            return "", []
        if not head.startswith(("{", PYTHON_TAG)):
            self._mode = "text"
            out, self._held = self._held, ""
            return out, []
        self._mode, self._rest = "calls", head.removeprefix(PYTHON_TAG)
        return "", self._take_calls()

    def _take_calls(self) -> list[ToolCall]:
        """Decode every whole call at the front of `_rest` (separators dropped)."""
        calls: list[ToolCall] = []
        while True:
            rest = self._rest.lstrip()
            if self.calls and rest.startswith(";"):
                rest = rest[1:].lstrip()
            if not rest.startswith("{"):
                return calls
            try:
                obj, end = self._decoder.raw_decode(rest)
            except json.JSONDecodeError:
                return calls  # not whole yet (or never: `finish` releases it)
            call = _call_from(obj, ("parameters", "arguments"))
            if call is None:
                return calls
            calls.append(call)
            self.calls += 1
            self._rest = rest[end:]

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self._mode != "calls" or not self.calls:
            out, self._held = self._held, ""
            return out, []
        rest, self._rest = self._rest, ""
        return ("" if rest.strip() in ("", ";") else rest), []


def parse_text(fmt: ToolCallFormat, text: str) -> tuple[str, list[ToolCall]]:
    """A whole output: (its content, its calls)."""
    parser = new_parser(fmt)
    content, calls = parser.feed(text)
    tail, more = parser.finish()
    return content + tail, calls + more


def new_parser(fmt: ToolCallFormat) -> ToolCallParser:
    return HermesParser() if fmt is ToolCallFormat.HERMES else Llama3JsonParser()
