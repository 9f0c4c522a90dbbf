"""No secret in any log line of a full run: `stagemesh serve` with two stages (data-plane
links with their tokens, the stages' pairing secret), API keys and the gateway; calls with
the right key, a wrong one and none, over gRPC and HTTP; then every line the router, the
stages and the gateway wrote is searched for the keys, the pairing secret, bearer headers
and anything that looks like a link token."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import openai
import pytest

from protos.stagemesh.v1 import inference_pb2 as pb
from router.audit import key_id
from router.client import RouterClient
from tests.mesh.harness import Mesh, free_port

pytestmark = pytest.mark.slow

KEY = "sk-live-7f3a9c2e51b84d06"
PAIRING = "pairing-3b9f0c1d7e2a4f68a5c9"  # the stages' secret, given to serve
WRONG = "sk-wrong-0d9e8f7a6b5c4d3e"
# A 32-byte link token printed as hex (64 digits; request ids have 32) or base64, or any
# bytes repr.
TOKEN_LIKE = re.compile(r"[0-9a-fA-F]{64}|[A-Za-z0-9+/]{43}=|b'\\x")


def test_no_secret_reaches_the_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGEMESH_STAGE_TOKEN", PAIRING)
    mesh = Mesh("--stages", "2", "--num-blocks", "128", "--api-key", KEY,
                gateway_port=free_port())
    try:
        async def grpc_calls() -> None:
            async with RouterClient(mesh.address,
                                    metadata=[("authorization", f"Bearer {KEY}")]) as client:
                out = await client.complete(prompt="Hello", max_tokens=4, request_id="s-1")
                assert out.token_ids[0]
            async with RouterClient(mesh.address,
                                    metadata=[("authorization", f"Bearer {WRONG}")]) as client:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await client.complete(prompt="Hello", max_tokens=4)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

        asyncio.run(grpc_calls())
        with pytest.raises(grpc.RpcError):
            list(mesh.stub().Generate(pb.GenerateRequest(text="Hi", max_tokens=2), timeout=10))
        base = f"{mesh.gateway_url}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key=WRONG, max_retries=0).models.list()
        reply = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0).completions.create(
            model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=4)
        assert reply.choices[0].text is not None
    finally:
        mesh.close()
    lines = list(mesh.proc.lines)
    assert any("pipeline ready" in line for line in lines)  # the run really logged
    leaks = [line for line in lines
             if KEY in line or WRONG in line or PAIRING in line or "Bearer" in line
             or TOKEN_LIKE.search(line)]
    assert leaks == []
    audit = [json.loads(line) for line in lines if line.startswith('{"time"')]
    assert {a["request_id"] for a in audit} >= {"s-1"}
    assert all(a["key_id"] in ("", key_id([("authorization", f"Bearer {KEY}")]))
               for a in audit)
