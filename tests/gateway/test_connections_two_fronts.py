"""A gateway with two router connections in front of a router with two front processes
(`api_processes=2`): its requests reach both fronts.

The router is the in-process mesh over null stages (front 0 and the engine core in the
test's loop, front 1 a real process on the same port); the gateway is the real app under
uvicorn on a real socket, in the same loop. The kernel hands each of the gateway's TCP
connections to one front, its own choice: a gateway whose two connections landed on the
same front is closed and another opened, until they reach different ones (each try 1/2).
Which front served a request is the core's count of requests finished by front; with the
null model the first token of a sequence also says it (tests/router/test_front_processes).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import uvicorn

from foundation.model_config import ModelConfig
from gateway.app import GatewayApp
from gateway.config import GatewayConfig
from tests.default_model import default_model_dir
from tests.router.inprocess import InProcessMesh, in_process_mesh
from tests.router.test_engine_inprocess import null_stages, wait_idle
from tests.router.test_front_processes import seq_of_first_token

TRIES = 20  # gateways to open until both connections reach different fronts (2^-20 to fail)
REQUESTS = 16


@asynccontextmanager
async def serving(app: GatewayApp) -> AsyncIterator[httpx.AsyncClient]:
    """`app` under uvicorn on a free port; an HTTP client to it. The server (and with it the
    app's lifespan: its router clients) is stopped on exit."""
    server = uvicorn.Server(uvicorn.Config(
        app, host="127.0.0.1", port=0, loop="none", http="httptools", lifespan="on",
        access_log=False, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "the gateway did not start"
            await asyncio.sleep(0.01)
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=30) as http:
            yield http
    finally:
        server.should_exit = True
        await task


async def finished_by_front(mesh: InProcessMesh) -> dict[int, int]:
    return dict((await mesh.app.front.stats()).finished_by_front)


async def front_of_next_request(mesh: InProcessMesh, http: httpx.AsyncClient) -> int:
    """Which front served one short request sent through the gateway."""
    before = await finished_by_front(mesh)
    response = await http.post("/v1/completions", json={"prompt": "probe", "max_tokens": 1,
                                                         "ignore_eos": True})
    assert response.status_code == 200, response.text
    after = await finished_by_front(mesh)
    changed = [f for f in after if after[f] != before.get(f, 0)]
    assert len(changed) == 1, (before, after)
    return changed[0]


def _body(i: int) -> dict[str, Any]:
    return {"prompt": f"request {i}", "max_tokens": 8 + i % 5, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True, "stream": i % 2 == 1}


async def completion(http: httpx.AsyncClient, i: int) -> tuple[list[int], str | None]:
    """Request `i`'s token ids and finish reason, streamed (odd i) or not."""
    body = _body(i)
    if not body["stream"]:
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["token_ids"], choice["finish_reason"]
    tokens: list[int] = []
    finish = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[len("data: "):])["choices"]:
                    tokens += choice.get("token_ids") or []
                    finish = choice["finish_reason"] or finish
    return tokens, finish


async def check_concurrent_requests(mesh: InProcessMesh, app: GatewayApp,
                                    http: httpx.AsyncClient, vocab: int) -> None:
    before = await finished_by_front(mesh)
    outs = await asyncio.gather(*(completion(http, i) for i in range(REQUESTS)))
    by_tokens = {0: 0, 1: 0}
    for i, (tokens, finish) in enumerate(outs):
        assert len(tokens) == _body(i)["max_tokens"] and finish == "length", (i, tokens)
        assert tokens == [(tokens[0] + k) % vocab for k in range(len(tokens))]
        by_tokens[seq_of_first_token(tokens[0], vocab)[0]] += 1
    after = await finished_by_front(mesh)
    by_core = {f: after.get(f, 0) - before.get(f, 0) for f in (0, 1)}
    assert by_core == by_tokens and by_core[0] > 0 and by_core[1] > 0, by_core
    assert app.running.router.outstanding == (0, 0)
    # Health, readiness and metrics through one connection: the core's counts of all fronts.
    assert (await http.get("/ready")).status_code == 200
    metrics = (await http.get("/metrics")).text
    finished = re.search(r"^stagemesh_router_requests_finished_total (\S+)$", metrics,
                         re.MULTILINE)
    assert finished and float(finished.group(1)) == sum(after.values())
    await wait_idle(app.running.router.first, mesh.stage_sequences)


def test_two_connections_spread_requests_over_two_fronts(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model_dir = default_model_dir()
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    monkeypatch.setenv("STAGEMESH_HOME", str(tmp_path))  # no tokenizer for the gateway

    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 2), api_processes=2) as mesh:
            cfg = GatewayConfig(router=mesh.address, port=0, router_connections=2)
            for _ in range(TRIES):
                app = GatewayApp(cfg)
                async with serving(app) as http:
                    # Idle requests take the connections in turn: one probe on each.
                    fronts = {await front_of_next_request(mesh, http) for _ in range(2)}
                    if fronts == {0, 1}:
                        await check_concurrent_requests(mesh, app, http, vocab)
                        return
            raise AssertionError(f"both connections reached one front in {TRIES} gateways")

    asyncio.run(run())
