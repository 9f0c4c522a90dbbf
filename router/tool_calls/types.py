"""Domain objects of tool calling (no protos, no HTTP)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from enum import StrEnum


class ToolChoiceMode(StrEnum):
    """OpenAI's tool_choice strings; a named function is `ToolChoice.function`."""

    NONE = "none"  # calls are not parsed; the chat template still gets the tools
    AUTO = "auto"  # the model may call tools: calls in its output are parsed
    REQUIRED = "required"  # one or more calls, forced with a grammar


@dataclass(frozen=True)
class ToolChoice:
    """`function` set: exactly one call of that tool (mode is then REQUIRED); None as a
    whole (on the request): auto with tools, none without."""

    mode: ToolChoiceMode
    function: str | None = None


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call. `parameters`: its arguments' JSON schema as JSON text
    ("" = none)."""

    name: str
    description: str = ""
    parameters: str = ""


@dataclass(frozen=True)
class ToolCall:
    """One call: `arguments` is JSON text (an object)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of call `index` of a choice: the first piece has the id and name
    and no arguments; later pieces carry argument text, appended in order."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


def new_call_id() -> str:
    """OpenAI's shape: "call_" and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def call_deltas(index: int, call: ToolCall) -> tuple[ToolCallDelta, ToolCallDelta]:
    """A whole call as its two streamed pieces: id and name, then the arguments."""
    return (ToolCallDelta(index, call.id, call.name, ""),
            ToolCallDelta(index, arguments=call.arguments))
