"""A chat request's tool fields as the router uses them: the messages and tools in the
shape chat templates take (HF's convention), and what the tool choice does to sampling."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from foundation.sampling_params import SamplingParams
from router.requests import ChatMessage, ChatPrompt, RawGenerateRequest
from router.tool_calls.parsers import ToolCallFormat
from router.tool_calls.plan import ToolsError, plan_tools
from router.tool_calls.types import ToolSpec


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Each message as the template reads it: an assistant's `tool_calls` as [{"id",
    "type": "function", "function": {"name", "arguments": <a dict>}}] (Hermes, Qwen2.5 and
    Llama 3.1 templates write `arguments | tojson`), a tool message's `tool_call_id` and
    `name` when set. Raises ToolsError for calls on a non-assistant message or arguments
    that are not a JSON object."""
    out = []
    for i, m in enumerate(messages):
        entry: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            if m.role != "assistant":
                raise ToolsError(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls: "
                                 f"only assistant messages make tool calls, not {m.role!r}")
            entry["tool_calls"] = [_template_call(f"messages[{i}].tool_calls[{j}]", call.id,
                                                  call.name, call.arguments)
                                   for j, call in enumerate(m.tool_calls)]
        if m.tool_call_id:
            entry["tool_call_id"] = m.tool_call_id
        if m.name:
            entry["name"] = m.name
        out.append(entry)
    return out


def _template_call(field: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError as e:
        raise ToolsError(f"{field}.function.arguments",
                         f"{field}.function.arguments is not JSON: {e}") from None
    if not isinstance(args, dict):
        raise ToolsError(f"{field}.function.arguments",
                         f"{field}.function.arguments must be a JSON object")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def template_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """The tools as templates take them: {"type": "function", "function": {"name",
    "description", "parameters"}} (`parameters` decoded; checked by `plan_tools` first)."""
    out = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            function["parameters"] = json.loads(tool.parameters)
        out.append({"type": "function", "function": function})
    return out


def apply_tool_choice(raw: RawGenerateRequest, parser: ToolCallFormat | None
                      ) -> tuple[SamplingParams, ToolCallFormat | None]:
    """The request's sampling (with the grammar that forces calls, for required or a
    named function) and the format its output's calls are parsed in (None: not parsed).
    `parser`: the router's --tool-call-parser (None: none). Raises ToolsError."""
    chat = raw.prompt if isinstance(raw.prompt, ChatPrompt) else None
    if chat is None:
        if raw.tool_choice is not None:
            raise ToolsError("tool_choice", "tool_choice needs a chat request with tools")
        return raw.sampling, None
    plan = plan_tools(chat.tools, raw.tool_choice, parser,
                      constrained=raw.sampling.structured is not None,
                      parallel=raw.parallel_tool_calls)
    if plan.constraint is None:
        return raw.sampling, plan.parse
    for name, bad in (("min_tokens", raw.sampling.min_tokens > 0),
                      ("ignore_eos", raw.ignore_eos)):
        if bad:
            raise ToolsError(name, f"{name} cannot be combined with tool_choice required or "
                                   "a named function (the output ends when the calls do)")
    return replace(raw.sampling, structured=plan.constraint), plan.parse
