"""The router's audit log: one JSON line per Generate call, over a real in-process mesh (null
stages): what it records for a completed, a refused and a cancelled call, the key's id but
never the key, and text only when asked for."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from router.audit import AuditRecord, key_id
from router.client import RouterClient
from tests.default_model import default_model_dir
from tests.router.inprocess import in_process_mesh
from tests.router.test_engine_inprocess import null_stages, wait_idle

KEY = "sk-audit-test-key-0123456789"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def audit_lines() -> Iterator[list[str]]:
    handler = _Lines()
    log = logging.getLogger("stagemesh.audit")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)


def test_key_id_is_a_hash_prefix_and_never_the_key() -> None:
    want = "sha256:" + hashlib.sha256(KEY.encode()).hexdigest()[:12]
    assert key_id([("authorization", f"Bearer {KEY}")]) == want
    assert key_id([("x-other", "v")]) == "" and key_id(None) == ""
    line = json.loads(AuditRecord("ipv4:1.2.3.4:5", want, "m", "r").line(content=False))
    assert set(line) == {"time", "request_id", "key_id", "client", "model", "prompt_tokens",
                         "completion_tokens", "finish_reasons", "status", "duration_ms"}


def _by_id(lines: list[str]) -> dict[str, dict[str, object]]:
    entries = [json.loads(line) for line in lines]
    return {str(e["request_id"]): e for e in entries}


def test_each_call_gets_one_line(audit_lines: list[str]) -> None:
    model_dir: Path = default_model_dir()

    async def run() -> None:
        bearer = [("authorization", f"Bearer {KEY}")]
        async with in_process_mesh(null_stages(model_dir, 2), api_keys=frozenset({KEY})) as mesh, \
                RouterClient(mesh.address, metadata=bearer) as client:
            out = await client.complete(prompt="hello there", max_tokens=4, ignore_eos=True,
                                        request_id="done-1")
            assert out.finish_reasons == ["length"]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.complete(prompt="x", max_tokens=4, temperature=-1.0,
                                      request_id="bad-1")
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            stream = client.generate(prompt="long", max_tokens=4000, ignore_eos=True,
                                     request_id="gone-1")
            await stream.__anext__()
            await stream.aclose()  # the client goes away mid-stream
            await wait_idle(client, mesh.stage_sequences)
            for _ in range(100):  # the cancelled call's line comes when its handler ends
                if "gone-1" in _by_id(audit_lines):
                    break
                await asyncio.sleep(0.02)

    asyncio.run(run())
    entries = _by_id(audit_lines)
    assert set(entries) == {"done-1", "bad-1", "gone-1"}
    done = entries["done-1"]
    assert done["status"] == "OK" and done["finish_reasons"] == ["length"]
    assert done["completion_tokens"] == 4 and int(str(done["prompt_tokens"])) > 0
    assert done["key_id"] == key_id([("authorization", f"Bearer {KEY}")])
    assert str(done["client"]).startswith("ipv4:127.0.0.1:")
    assert done["model"] == model_dir.name and "prompt" not in done and "output" not in done
    assert entries["bad-1"]["status"] == "INVALID_ARGUMENT"
    assert entries["gone-1"]["status"] == "CANCELLED"
    assert not any(KEY in line for line in audit_lines)


def test_content_only_when_asked(audit_lines: list[str]) -> None:
    model_dir = default_model_dir()

    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 1), audit_log_content=True) as mesh, \
                mesh.client() as client:
            await client.complete(prompt="hello there", max_tokens=3, ignore_eos=True,
                                  request_id="c-1")

    asyncio.run(run())
    (entry,) = [json.loads(line) for line in audit_lines]
    assert entry["key_id"] == "" and "hello there" in entry["prompt"]
    assert isinstance(entry["output"], list) and len(entry["output"]) == 1
