"""Structured output through the real 2-stage mesh (the default model; the last stage holds
the matchers): OpenAI's response_format and vLLM's guided_* fields with the official openai
client, streamed and not, and the public gRPC API's StructuredOutput. Every output is
checked by a validator nobody here wrote (jsonschema, re); bad constraints are 400 /
INVALID_ARGUMENT naming the field, and the KV they never used stays idle."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest

from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc
from tests.gateway.conftest import MODEL
from tests.mesh.harness import wait_idle

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "London", "Rome"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def test_json_schema_samples_all_validate(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=ASK,  # type: ignore[call-overload]
                                         response_format=fmt, n=4, seed=1,
                                         temperature=1.0, max_tokens=80)
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_streamed_json_object_and_guided_fields(client: openai.OpenAI) -> None:
    prompt = 'One JSON object per line.\n{"x": 1}\n{"x": 2}\n{"x": 3}\n'
    stream = client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                       extra_body={"response_format": {"type": "json_object"}},
                                       temperature=0.0, max_tokens=40)
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and isinstance(json.loads(text), dict), text

    phone = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    out = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=30,
                                    extra_body={"guided_regex": phone})
    assert re.fullmatch(phone, out.choices[0].text), out.choices[0].text
    out = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=10, n=2,
                                    temperature=1.0, seed=3,
                                    extra_body={"guided_choice": ["blue", "grey", "green"]})
    assert all(c.text in ("blue", "grey", "green") and c.finish_reason == "stop"
               for c in out.choices), out.choices
    out = client.completions.create(
        model=MODEL, prompt="2 + 2 =", max_tokens=20,
        extra_body={"guided_grammar": 'root ::= "The answer is " [0-9]+ "."'})
    assert re.fullmatch(r"The answer is [0-9]+\.", out.choices[0].text), out.choices[0].text
    out = client.completions.create(model=MODEL, prompt="A person:", max_tokens=80,
                                    extra_body={"guided_json": json.dumps(PERSON)})
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)


def test_bad_constraints_are_400_naming_the_field(client: openai.OpenAI) -> None:
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}}, "response_format", "objekt"),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex", "unclosed"),
        ({"extra_body": {"guided_grammar": "root ::= nothing"}}, "guided_grammar", "nothing"),
        ({"extra_body": {"guided_json": {"type": "object"}, "min_tokens": 3}}, "min_tokens",
         "cannot be combined"),
        ({"extra_body": {"guided_choice": ["a"], "ignore_eos": True}}, "ignore_eos",
         "cannot be combined"),
    ]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                           **kwargs)  # type: ignore[call-overload]
        body = err.value.body
        assert isinstance(body, dict) and body.get("param") == param, (kwargs, body)
        assert words in body["message"], body


def test_grpc_structured_output(stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    req = pb.GenerateRequest(text="Pick a fruit:", max_tokens=10, sampling=pb.SamplingParams(
        structured_output=pb.StructuredOutput(choice=pb.Choices(options=["apple", "pear"]))))
    texts = "".join(r.text for r in stub.Generate(req))
    assert texts in ("apple", "pear")
    req = pb.GenerateRequest(text="Hi", max_tokens=10, sampling=pb.SamplingParams(
        structured_output=pb.StructuredOutput(json_schema='{"type": "objekt"}')))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("structured_output.json_schema"), \
        err.value.details()
    wait_idle(stub)  # KV back to idle on the router and every stage
