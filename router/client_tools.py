"""Tool calling in OpenAI's request shapes -> the public protos, for `RouterClient` callers
(the gateway, tests): tools, tool_choice and chat messages with tool calls."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from protos.stagemesh.v1 import inference_pb2 as pb

_MODES = {"none": pb.TOOL_CHOICE_MODE_NONE, "auto": pb.TOOL_CHOICE_MODE_AUTO,
          "required": pb.TOOL_CHOICE_MODE_REQUIRED}

# A streamed tool-call piece: (index, id, name, arguments); see GenerateResponse.tool_calls.
ToolCallPiece = tuple[int, str, str, str]


def message_to_proto(m: Mapping[str, Any]) -> pb.ChatMessage:
    """{"role", "content", and optionally "tool_calls" (OpenAI's [{"id", "type",
    "function": {"name", "arguments": JSON text or an object}}]), "tool_call_id", "name"}."""
    msg = pb.ChatMessage(role=m["role"], content=m.get("content") or "",
                         tool_call_id=m.get("tool_call_id") or "", name=m.get("name") or "")
    for call in m.get("tool_calls") or ():
        function = call.get("function", {})
        args = function.get("arguments", "")
        msg.tool_calls.add(id=call.get("id", ""), name=function.get("name", ""),
                           arguments=args if isinstance(args, str) else json.dumps(args))
    return msg


def tools_to_proto(tools: Sequence[Mapping[str, Any]]) -> list[pb.Tool]:
    """OpenAI's tools ({"type": "function", "function": {"name", "description",
    "parameters"}}) as Tool messages (the parameters as JSON text)."""
    out = []
    for tool in tools:
        function = tool.get("function", {})
        params = function.get("parameters")
        out.append(pb.Tool(name=function.get("name", ""),
                           description=function.get("description") or "",
                           parameters="" if params is None else json.dumps(params)))
    return out


def tool_choice_to_proto(choice: str | Mapping[str, Any]) -> pb.ToolChoice:
    """"none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}.
    Raises ValueError for anything else."""
    if isinstance(choice, str):
        if choice not in _MODES:
            raise ValueError(f"tool_choice must be none, auto or required, got {choice!r}")
        return pb.ToolChoice(mode=_MODES[choice])
    return pb.ToolChoice(function=choice["function"]["name"])


def tool_call_pieces(msg: pb.GenerateResponse) -> tuple[ToolCallPiece, ...]:
    return tuple((d.index, d.id, d.name, d.arguments) for d in msg.tool_calls)
