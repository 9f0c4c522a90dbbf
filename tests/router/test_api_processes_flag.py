"""`--api-processes`: the flag on `stagemesh router` and `serve`, and the router as a real
process with two fronts (its engine core and its front process are its children) over an
in-process null stage."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import grpc
import pytest

from foundation.ports import free_port
from router.client import RouterClient
from stagemesh.cli import build_parser
from stagemesh.cli_services import router_config
from stagemesh.launcher import build_children
from stagemesh.local_mesh import Proc
from tests.default_model import default_model_dir
from tests.processes import child_pids
from tests.router.inprocess import start_stage
from tests.router.test_engine_inprocess import null_stages
from tests.router.test_front_processes import readiness_gone, seq_of_first_token


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


def test_the_flag_reaches_the_router_config_and_serve_passes_it_on(model_dir: Path,
                                                                    tmp_path: Path) -> None:
    parser = build_parser()
    args = parser.parse_args(["router", "--model", str(model_dir), "--api-processes", "3"])
    assert router_config(args, ("127.0.0.1:1",)).api_processes == 3
    default = parser.parse_args(["router", "--model", str(model_dir)])
    assert router_config(default, ("127.0.0.1:1",)).api_processes == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["router", "--api-processes", "0"])
    serve = parser.parse_args(["serve", "--model", str(model_dir), "--device", "cpu",
                               "--api-processes", "2"])
    router = next(c for c in build_children(serve, tmp_path) if c.role == "router")
    i = router.argv.index("--api-processes")
    assert router.argv[i + 1] == "2"


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def _client_on(address: str, front: int, vocab: int) -> RouterClient:
    """A client whose connection the kernel gave to `front` (null model: a request's first
    token says which front numbered its sequence)."""
    for _ in range(64):
        client = RouterClient(address, own_connection=True)
        out = await client.complete(prompt="probe", max_tokens=1, ignore_eos=True)
        if seq_of_first_token(out.token_ids[0][0], vocab)[0] == front:
            return client
        await client.close()
    raise AssertionError(f"no connection landed on front {front}")


def test_router_process_with_two_fronts_serves_and_drains_on_sigterm(model_dir: Path) -> None:
    """Both fronts answer GetModelInfo and GetStats alike; SIGTERM on the router makes both
    NOT_SERVING while the request in flight on each finishes whole; then the router exits 0
    and its engine core and front process are gone."""
    long = 600

    async def run() -> None:
        stage = await start_stage(null_stages(model_dir, 1)[0])
        port = free_port()
        proc = Proc([sys.executable, "-m", "stagemesh", "router", "--model", str(model_dir),
                     "--stages", stage.address, "--port", str(port), "--api-processes", "2"])
        try:
            await asyncio.to_thread(proc.wait_for, r"1 front process\(es\) serve", 60)
            children = child_pids(proc.proc.pid)
            assert len(children) == 2  # the engine core and front process 1
            address = f"127.0.0.1:{port}"
            async with RouterClient(address) as probe:
                vocab = (await probe.model_info()).vocab_size
            a, b = await _client_on(address, 0, vocab), await _client_on(address, 1, vocab)
            assert await a.model_info() == await b.model_info()
            stats_a, stats_b = await a.stats(), await b.stats()
            assert stats_a.requests_finished == stats_b.requests_finished >= 2
            assert stats_a.kv_blocks_total == stats_b.kv_blocks_total > 0

            streams = [c.generate(prompt="long", max_tokens=long, ignore_eos=True)
                       for c in (a, b)]
            received = [len((await s.__anext__()).token_ids) for s in streams]
            proc.proc.send_signal(signal.SIGTERM)
            for client in (a, b):
                assert await readiness_gone(client), "readiness stayed SERVING"
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await client.complete(prompt="late", max_tokens=4)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            for i, stream in enumerate(streams):
                async for chunk in stream:
                    received[i] += len(chunk.token_ids)
            assert received == [long, long]
            assert await asyncio.to_thread(proc.proc.wait, 30) == 0
            assert not [pid for pid in children if _alive(pid)]
            assert "Traceback" not in proc.output, proc.output
            await a.close()
            await b.close()
        finally:
            proc.stop(timeout=30)
            await stage.stop()

    asyncio.run(run())
