"""A request's tools and tool choice, checked, and what they make the router do: parse calls
out of the output (`ToolPlan.parse`) and, for `required` or a named function, force the
output into calls with a grammar (`ToolPlan.constraint`).

The grammar writes exactly what the parser reads (`forced_calls_grammar`), with each call's
JSON held to `{"name": <one of the allowed names>, "arguments": <that tool's parameters
schema>}` by llguidance's `%json`, so a choice that ends with `stop` parses into calls whose
arguments validate. Limits: at most MAX_TOOLS tools, names as OpenAI's (1-64 of a-z, A-Z,
0-9, '_', '-'), unique, each parameters schema a JSON object, the grammar at most
MAX_SPEC_BYTES.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from foundation.structured_output import (
    MAX_SPEC_BYTES,
    ConstraintKind,
    StructuredOutput,
    StructuredOutputError,
)
from router.tool_calls.parsers import ToolCallFormat
from router.tool_calls.types import ToolChoice, ToolChoiceMode, ToolSpec

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# As the structured output's JSON: fixed separators, no free whitespace a small model could
# emit forever.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolsError(ValueError):
    """A bad `tools` or `tool_choice`; `field` names it as the API spells it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ToolPlan:
    """parse: the format calls are parsed from the output in (None: not parsed);
    constraint: the grammar that forces calls (None: the output is free)."""

    parse: ToolCallFormat | None = None
    constraint: StructuredOutput | None = None


def plan_tools(tools: Sequence[ToolSpec], choice: ToolChoice | None,
               fmt: ToolCallFormat | None, constrained: bool,
               parallel: bool = True) -> ToolPlan:
    """Check the tools and the choice; `fmt`: the router's parser (None: it has none);
    `constrained`: the request has a structured output constraint of its own; `parallel`:
    several calls may be forced (OpenAI's parallel_tool_calls).

    Raises ToolsError."""
    schemas = check_tools(tools)
    mode = choice.mode if choice is not None else (
        ToolChoiceMode.AUTO if tools else ToolChoiceMode.NONE)
    if mode is ToolChoiceMode.NONE:
        return ToolPlan()
    if not tools:
        raise ToolsError("tool_choice", f"tool_choice {_choice_text(choice)} needs tools; "
                                        "the request has none")
    if fmt is None:
        raise ToolsError("tool_choice", f"tool_choice {_choice_text(choice)}: this server "
                                        "has no tool-call parser for its model (start the "
                                        "router with --tool-call-parser hermes or "
                                        "llama3_json), so only tool_choice none is served")
    if mode is ToolChoiceMode.AUTO:
        return ToolPlan(parse=fmt)
    if constrained:
        raise ToolsError("tool_choice", f"tool_choice {_choice_text(choice)} cannot be "
                                        "combined with a structured output constraint "
                                        "(response_format, guided_*): the output is tool calls")
    names = [t.name for t in tools]
    if choice is not None and choice.function is not None:
        if choice.function not in names:
            raise ToolsError("tool_choice", f"tool_choice names function "
                                            f"{choice.function!r}, which is not one of the "
                                            f"request's tools ({', '.join(names)})")
        schemas = {choice.function: schemas[choice.function]}
        parallel = False
    grammar = forced_calls_grammar(fmt, schemas, several=parallel)
    if len(grammar.encode()) > MAX_SPEC_BYTES:
        raise ToolsError("tools", f"tools: the grammar forcing the calls is "
                                  f"{len(grammar.encode())} bytes; at most {MAX_SPEC_BYTES} "
                                  "are accepted (fewer or smaller parameter schemas)")
    constraint = StructuredOutput(ConstraintKind.GRAMMAR, grammar)
    try:
        constraint.validate()
    except StructuredOutputError as e:
        reason = e.message.removeprefix("structured_output.grammar: ").splitlines()[0]
        raise ToolsError("tools", f"tools: a parameters schema cannot be enforced: "
                                  f"{reason}") from None
    return ToolPlan(parse=fmt, constraint=constraint)


def _choice_text(choice: ToolChoice | None) -> str:
    if choice is not None and choice.function is not None:
        return f"function {choice.function!r}"
    return repr(choice.mode.value if choice is not None else ToolChoiceMode.AUTO.value)


def check_tools(tools: Sequence[ToolSpec]) -> dict[str, dict[str, object]]:
    """name -> its parameters schema, in order. Raises ToolsError (the count, a name, a
    parameters schema that is not a JSON object)."""
    if len(tools) > MAX_TOOLS:
        raise ToolsError("tools", f"tools has {len(tools)} functions, at most {MAX_TOOLS} "
                                  "are allowed")
    schemas: dict[str, dict[str, object]] = {}
    for i, tool in enumerate(tools):
        field = f"tools[{i}].function"
        if not _NAME.fullmatch(tool.name):
            raise ToolsError(f"{field}.name", f"{field}.name must be 1 to 64 characters of "
                                              f"a-z, A-Z, 0-9, '_' and '-', got {tool.name!r}")
        if tool.name in schemas:
            raise ToolsError(f"{field}.name", f"{field}.name {tool.name!r} is given twice; "
                                              "function names must be unique")
        schemas[tool.name] = _parameters(f"{field}.parameters", tool.parameters)
    return schemas


def _parameters(field: str, text: str) -> dict[str, object]:
    if not text:
        return dict(_NO_ARGUMENTS)
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise ToolsError(field, f"{field} is {len(text.encode())} bytes; at most "
                                f"{MAX_SPEC_BYTES} are accepted")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolsError(field, f"{field} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ToolsError(field, f"{field} must be a JSON schema object, got "
                                f"{type(schema).__name__}")
    return schema


def forced_calls_grammar(fmt: ToolCallFormat, schemas: dict[str, dict[str, object]],
                         several: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are one call (or, `several`,
    one or more) of the named tools in `fmt`'s layout, as the model's chat template shows
    them: hermes `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` joined by
    newlines; llama3_json `{"name": ..., "parameters": ...}` joined by "; "."""
    key = "arguments" if fmt is ToolCallFormat.HERMES else "parameters"
    calls = [{"type": "object", "properties": {"name": {"const": name}, key: schema},
              "required": ["name", key], "additionalProperties": False}
             for name, schema in schemas.items()]
    call_schema = {"x-guidance": _JSON_STYLE,
                   **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
    body = "%json " + json.dumps(call_schema, ensure_ascii=False)
    if fmt is ToolCallFormat.HERMES:
        call, sep = f'"<tool_call>\\n" {body} "\\n</tool_call>"', '"\\n"'
    else:
        call, sep = body, '"; "'
    start = f"call ({sep} call)*" if several else "call"
    return f"start: {start}\ncall: {call}\n"
