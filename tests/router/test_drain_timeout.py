"""`--drain-timeout`: the flag on `stagemesh router`, `serve` and `gateway`, and a router
process whose drain timeout cuts a request that outlives it (over an in-process null
stage)."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from foundation.ports import free_port
from router.client import RouterClient
from stagemesh.cli import build_parser
from stagemesh.cli_gateway import gateway_config
from stagemesh.cli_services import router_config
from stagemesh.launcher import build_children
from stagemesh.local_mesh import Proc
from tests.default_model import default_model_dir
from tests.router.inprocess import start_stage
from tests.router.test_engine_inprocess import null_stages
from tests.router.test_front_processes import readiness_gone


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


def test_the_flag_reaches_router_and_gateway_and_serve_passes_it_on(model_dir: Path,
                                                                   tmp_path: Path) -> None:
    parser = build_parser()
    args = parser.parse_args(["router", "--model", str(model_dir), "--drain-timeout", "2.5"])
    assert router_config(args, ("127.0.0.1:1",)).drain_timeout_s == 2.5
    default = parser.parse_args(["router", "--model", str(model_dir)])
    assert router_config(default, ("127.0.0.1:1",)).drain_timeout_s == 30.0
    gateway = parser.parse_args(["gateway", "--drain-timeout", "0"])
    assert gateway_config(gateway).drain_timeout_s == 0.0
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["router", "--drain-timeout", bad])
    serve = parser.parse_args(["serve", "--model", str(model_dir), "--device", "cpu",
                               "--drain-timeout", "90"])
    children = {c.role: c for c in build_children(serve, tmp_path)}
    for role in ("router", "gateway"):
        argv = children[role].argv
        assert argv[argv.index("--drain-timeout") + 1] == "90.0", role


def test_a_request_longer_than_the_drain_timeout_is_cut_and_the_router_exits(
        model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM with `--drain-timeout 1`: readiness goes, the request in flight (far longer
    than a second) ends with UNAVAILABLE about a second later, and the router exits 0 in
    a few seconds, not after the default 30."""

    async def run() -> None:
        stage = await start_stage(null_stages(model_dir, 1)[0])
        leader = stage.servicer.leader
        overlapped = leader.step_overlapped

        def paced(*args: Any) -> None:  # a model's time: the request takes 4 s or more
            time.sleep(0.001)
            overlapped(*args)
        leader.step_overlapped = paced  # type: ignore[method-assign]
        port = free_port()
        ready = tmp_path / "ready"
        proc = Proc([sys.executable, "-m", "stagemesh", "router", "--model", str(model_dir),
                     "--stages", stage.address, "--port", str(port), "--drain-timeout", "1",
                     "--ready-file", str(ready)])
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                assert proc.proc.poll() is None and time.monotonic() < deadline, proc.output
                await asyncio.sleep(0.1)
            async with RouterClient(f"127.0.0.1:{port}") as client:
                model = await client.model_info()
                wanted = min(model.max_tokens_limit, model.context_length - 8)
                stream = client.generate(prompt="long", max_tokens=wanted, ignore_eos=True)
                received = len((await stream.__anext__()).token_ids)
                proc.proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                assert await readiness_gone(client), "readiness stayed SERVING"
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for chunk in stream:
                        received += len(chunk.token_ids)
                cut_after = time.monotonic() - signalled
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
            assert 0 < received < wanted, (received, wanted)
            assert 0.5 < cut_after < 10, cut_after
            print(f"cut after {cut_after:.2f} s at {received} of {wanted} tokens")
            assert await asyncio.to_thread(proc.proc.wait, 20) == 0
            assert "Traceback" not in proc.output, proc.output
        finally:
            proc.stop(timeout=30)
            await stage.stop()

    asyncio.run(run())
