"""Tool calling in OpenAI's chat request shapes -> `router.client.build_request`'s keywords.

`tools`: [{"type": "function", "function": {"name", "description", "parameters",
"strict"}}]; `tool_choice`: "none" | "auto" | "required" | {"type": "function", "function":
{"name"}}; `parallel_tool_calls`: a boolean. In `messages`: an assistant message's
`tool_calls` ([{"id", "type": "function", "function": {"name", "arguments"}}], arguments as
JSON text) and a tool message's `tool_call_id`. Only shapes and types are checked here; the
router checks names, counts, schemas and that tool_choice names one of the tools, and parses
the calls out of the output (`router.tool_calls`).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import invalid
from gateway.fields import Fields, wrong_type

_MODES = ("none", "auto", "required")


def tool_options(f: Fields) -> dict[str, Any]:
    """build_request's tools, tool_choice and parallel_tool_calls (None when unset)."""
    return {"tools": parse_tools(f), "tool_choice": _tool_choice(f.raw("tool_choice")),
            "parallel_tool_calls": f.boolean("parallel_tool_calls")}


def parse_tools(f: Fields) -> list[dict[str, Any]] | None:
    """The body's `tools`, shapes checked (None when unset)."""
    value = f.array("tools")
    if value is None:
        return None
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise wrong_type(f"tools[{i}]", "an object", item)
        tool = Fields(item, f"tools[{i}].")
        if tool.string("type") != "function":
            raise invalid(f"tools[{i}].type", f"tools[{i}].type must be 'function'")
        fn = tool.obj("function")
        if fn is None:
            raise invalid(f"tools[{i}].function", f"tools[{i}].function is required")
        tool.refuse_unknown()
        name = fn.string("name")
        if name is None:
            raise invalid(f"tools[{i}].function.name", f"tools[{i}].function.name is required")
        function: dict[str, Any] = {"name": name}
        if (description := fn.string("description")) is not None:
            function["description"] = description
        if (params := fn.obj("parameters")) is not None:
            function["parameters"] = params.body
        fn.boolean("strict")  # the parameters are always enforced when calls are forced
        fn.refuse_unknown()
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any) -> str | dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in _MODES:
            raise invalid("tool_choice", "tool_choice must be none, auto, required or "
                                         f"{{\"type\": \"function\", ...}}, got {value!r}")
        return value
    if not isinstance(value, dict):
        raise wrong_type("tool_choice", "a string or an object", value)
    choice = Fields(value, "tool_choice.")
    if choice.string("type") != "function":
        raise invalid("tool_choice.type", "tool_choice.type must be 'function'")
    fn = choice.obj("function")
    name = fn.string("name") if fn is not None else None
    if name is None:
        raise invalid("tool_choice.function.name", "tool_choice.function.name is required")
    choice.refuse_unknown()
    return {"type": "function", "function": {"name": name}}


def message_tool_fields(m: Fields, role: str, name: str) -> dict[str, Any]:
    """A message's tool fields (`name` is the message's place, "messages[2]"): an
    assistant's tool_calls, a tool message's tool_call_id (required) and name."""
    out: dict[str, Any] = {}
    calls = m.array("tool_calls")
    if calls is not None and role != "assistant":
        raise invalid(f"{name}.tool_calls", f"{name}.tool_calls: only assistant messages "
                                            "make tool calls")
    if calls:
        out["tool_calls"] = [_call(f"{name}.tool_calls[{j}]", call)
                             for j, call in enumerate(calls)]
    call_id = m.string("tool_call_id")
    if role == "tool":
        if call_id is None:
            raise invalid(f"{name}.tool_call_id", f"{name}.tool_call_id is required for role "
                                                  "tool")
        out["tool_call_id"] = call_id
        if (fn_name := m.string("name")) is not None:
            out["name"] = fn_name
    return out


def _call(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise wrong_type(name, "an object", value)
    call = Fields(value, f"{name}.")
    call_id = call.string("id") or ""
    if call.string("type") not in (None, "function"):
        raise invalid(f"{name}.type", f"{name}.type must be 'function'")
    fn = call.obj("function")
    if fn is None:
        raise invalid(f"{name}.function", f"{name}.function is required")
    fn_name, args = fn.string("name"), fn.string("arguments")
    if fn_name is None:
        raise invalid(f"{name}.function.name", f"{name}.function.name is required")
    return {"id": call_id, "type": "function",
            "function": {"name": fn_name, "arguments": args or "{}"}}
