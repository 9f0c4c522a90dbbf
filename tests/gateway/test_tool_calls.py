"""Tool calls through the real mesh (one CPU stage) serving the default model with a Hermes
(Qwen2.5-style) chat template, so `--tool-call-parser auto` picks hermes: with the official
openai client over the gateway and over the public gRPC API.

The model is too small to call a tool by itself, so the end-to-end calls are forced
(tool_choice required or a named function: the grammar writes the parser's format, the
parser reads it back); every call's arguments are checked against its function's schema
with jsonschema. Parsing of free outputs is tested on fixed texts
(tests/router/test_tool_call_parsers.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc
from router.client import build_request
from stagemesh.local_mesh import Mesh, free_port
from tests.tool_chat_model import write_tool_chat_model

pytestmark = pytest.mark.slow

MODEL = "tool-model"
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "London", "Rome"]},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The weather in a city now.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description":
                                           "The time in a time zone.",
                                           "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HISTORY = [*ASK,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    model = write_tool_chat_model(tmp_path_factory.mktemp("model") / MODEL)
    with Mesh("--model", str(model), "--stages", "1", "--num-blocks", "128",
              gateway_port=free_port()) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.gateway_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def stub(mesh: Mesh) -> inference_pb2_grpc.InferenceServiceStub:
    return mesh.stub()


def _check_call(name: str, arguments: str) -> dict[str, Any]:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def _streamed_calls(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[dict[str, Any]],
                                                                    str | None]:
    """(content, calls reassembled from the deltas, finish reason), checking OpenAI's
    delta shape: a call's first delta has id, type and name, later ones only arguments."""
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            if piece.id is not None:
                assert piece.index == len(calls) and piece.type == "function"
                assert piece.function is not None and piece.function.name
                calls.append({"id": piece.id, "name": piece.function.name,
                              "arguments": piece.function.arguments or ""})
            else:
                assert piece.function is not None and piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def test_named_function_is_called_streamed_or_not(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS,
                              "tool_choice": NAMED, "temperature": 0.0, "max_tokens": 60}
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function"
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    args = _check_call("get_weather", calls[0].function.arguments)
    content, streamed, finish = _streamed_calls(client, **kwargs)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [("get_weather", args)]


def test_required_calls_one_of_the_tools_in_every_choice(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,  # type: ignore[call-overload]
                                         tool_choice="required", parallel_tool_calls=False,
                                         n=3, seed=5, temperature=1.0, max_tokens=60)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls or []
        assert len(calls) == 1, calls
        _check_call(calls[0].function.name, calls[0].function.arguments)


def test_none_and_auto_answer_in_text_and_the_template_still_sees_the_tools(
        client: openai.OpenAI, mesh: Mesh) -> None:
    for choice in ("none", "auto"):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,  # type: ignore[call-overload]
                                             tool_choice=choice, temperature=0.0,
                                             max_tokens=8)
        message = out.choices[0].message
        assert message.tool_calls is None and message.content, message
        assert out.choices[0].finish_reason in ("stop", "length")
    import httpx2 as httpx

    with httpx.Client(base_url=mesh.gateway_url or "", timeout=30) as http:
        plain = http.post("/tokenize", json={"messages": ASK}).json()["count"]
        tooled = http.post("/tokenize", json={"messages": ASK, "tools": TOOLS}).json()["count"]
    prompt = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,  # type: ignore[call-overload]
                                            tool_choice="none", max_tokens=1).usage
    assert prompt is not None and prompt.prompt_tokens == tooled > plain + 50


def test_history_with_calls_and_results_reaches_the_template(
        client: openai.OpenAI, stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    req = build_request(messages=HISTORY, tools=TOOLS)
    reply = stub.Tokenize(pb.TokenizeRequest(chat=req.chat))
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>') in reply.prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in reply.prompt
    assert '"name": "get_time"' in reply.prompt  # the tools, in the system turn
    out = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS,  # type: ignore[call-overload]
                                         temperature=0.0, max_tokens=4)
    assert out.usage is not None and out.usage.prompt_tokens == len(reply.token_ids)


BAD = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not one of the request's tools"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "required"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name", "1 to 64 characters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters", "must be an object"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2},
     "tools[1].function.name", "unique"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "tools", "at most 128"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "none, auto, required"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objekt"}}}], "tool_choice": "required"}, "tools", "objekt"),
    ({"messages": [*ASK, {"role": "tool", "content": "1"}]}, "messages[1].tool_call_id",
     "required"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "not JSON"),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD)
def test_bad_tools_are_400_naming_the_field(client: openai.OpenAI, body: dict[str, Any],
                                            param: str, words: str) -> None:
    kwargs = {"messages": ASK, "tools": TOOLS, **body}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=4, **kwargs)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert words in error["message"], error


def test_grpc_complete_and_generate_return_parsed_calls(
        stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    req = build_request(messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0.0,
                        max_tokens=60)
    reply = stub.Complete(pb.CompleteRequest(request=req))
    choice = reply.choices[0]
    assert choice.finish_reason == pb.FINISH_REASON_TOOL_CALLS and choice.text == ""
    assert [c.name for c in choice.tool_calls] == ["get_weather"]
    args = _check_call("get_weather", choice.tool_calls[0].arguments)
    pieces = [d for msg in stub.Generate(req) for d in msg.tool_calls]
    assert pieces[0].id.startswith("call_") and pieces[0].name == "get_weather"
    assert not pieces[0].arguments and all(not p.id and not p.name for p in pieces[1:])
    assert json.loads("".join(p.arguments for p in pieces)) == args


@pytest.mark.parametrize(("choice", "tools", "words"), [
    (pb.ToolChoice(function="nope"), TOOLS, "not one of the request's tools"),
    (pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), [], "needs tools"),
])
def test_grpc_bad_tool_choice_is_invalid_argument(
        stub: inference_pb2_grpc.InferenceServiceStub, choice: pb.ToolChoice,
        tools: list[dict[str, Any]], words: str) -> None:
    req = build_request(messages=ASK, tools=tools, max_tokens=4)
    req.tool_choice.CopyFrom(choice)
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(pb.CompleteRequest(request=req))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("tool_choice") and words in info.value.details()
