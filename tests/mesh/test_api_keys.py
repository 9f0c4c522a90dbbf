"""API keys across the mesh: `stagemesh serve --api-key` makes the router and the gateway
require them; the gateway presents one to the router; health and reflection stay open."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import grpc
import openai
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from protos.stagemesh.v1 import inference_pb2 as pb
from router.client import RouterClient
from tests.mesh.harness import Mesh, free_port, readiness

pytestmark = pytest.mark.slow

KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    flags = ("--stages", "1", "--num-blocks", "128", "--api-key", KEYS[0], "--api-key", KEYS[1])
    with Mesh(*flags, gateway_port=free_port()) as m:
        yield m


def _bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


@pytest.mark.parametrize("metadata", [[], _bearer("wrong"), [("authorization", KEYS[0])]],
                         ids=["none", "wrong-key", "no-scheme"])
def test_router_refuses_calls_without_a_valid_key(mesh: Mesh, metadata: list) -> None:
    stub = mesh.stub()
    with pytest.raises(grpc.RpcError) as unary:
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10, metadata=metadata)
    assert unary.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in (unary.value.details() or "")
    request = pb.GenerateRequest(text="Hello", max_tokens=4)
    with pytest.raises(grpc.RpcError) as streaming:
        list(stub.Generate(request, timeout=10, metadata=metadata))
    assert streaming.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("key", KEYS)
def test_router_serves_every_configured_key(mesh: Mesh, key: str) -> None:
    async def run() -> str:
        async with RouterClient(mesh.address, metadata=_bearer(key)) as client:
            out = await client.complete(messages=[{"role": "user", "content":
                                                   "What is the capital of France?"}],
                                        temperature=0.0, max_tokens=16)
            return out.texts[0]
    assert "Paris" in asyncio.run(run())


def test_health_and_reflection_need_no_key(mesh: Mesh) -> None:
    assert readiness(mesh.address) == 1
    with grpc.insecure_channel(mesh.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert "stagemesh.v1.InferenceService" in services


def test_gateway_requires_a_key_and_presents_one_to_the_router(mesh: Mesh) -> None:
    base = f"{mesh.gateway_url}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=base, api_key=KEYS[1], max_retries=0)
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=16,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in (reply.choices[0].message.content or "")


def test_ask_takes_the_key_from_the_environment(mesh: Mesh) -> None:
    cmd = [sys.executable, "-m", "stagemesh", "ask", "--router", mesh.address,
           "--max-tokens", "8", "Hi"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1
    assert refused.stderr.strip().startswith("stagemesh ask: UNAUTHENTICATED: missing or")
    assert "Traceback" not in refused.stderr
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                        env={**os.environ, "STAGEMESH_API_KEY": KEYS[0]})
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip()
