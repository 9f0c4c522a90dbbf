"""Mutual TLS on every gRPC hop, over real processes: stages that accept only the router's
client certificate, a router that serves TLS and accepts only clients its CA signed, and a
gateway that reaches the router with its own client certificate; the two stages' data-plane
link is TLS too (each stage's certificate, checked against the CA)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from foundation.ports import free_port
from router.client import RouterClient
from stagemesh.local_mesh import Proc
from tests.default_model import default_model_dir
from tests.tls_certs import Pki, write_pki

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass(frozen=True)
class TlsMesh:
    pki: Pki
    router: str
    gateway: str
    stage: str
    stages: tuple[str, ...]


def _creds(ca: Path, cert: Path | None = None, key: Path | None = None
           ) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        ca.read_bytes(), key.read_bytes() if key else None, cert.read_bytes() if cert else None)


def _client(mesh: TlsMesh) -> grpc.ChannelCredentials:
    return _creds(mesh.pki.ca, mesh.pki.client_cert, mesh.pki.client_key)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsMesh]:
    pki = write_pki(tmp_path_factory.mktemp("pki"))
    stage_ports, router_port, http_port = (free_port(), free_port()), free_port(), free_port()
    server = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
              "--tls-client-ca", str(pki.ca)]
    cmd = [sys.executable, "-m", "stagemesh"]
    model = str(default_model_dir())
    stages = tuple(f"127.0.0.1:{port}" for port in stage_ports)
    procs = [
        *(Proc([*cmd, "stage", "--model", model, "--device", "cpu", "--num-blocks", "128",
                "--stage-index", str(i), "--num-stages", "2", "--port", str(port), *server,
                "--dataplane-tls-ca", str(pki.ca)])
          for i, port in enumerate(stage_ports)),
        # TLS is for the data plane between hosts; stages of one host would link over unix
        # under auto (no TLS: the bytes never leave the host), so tcp is asked for here.
        Proc([*cmd, "router", "--model", model, "--stages", ",".join(stages),
              "--port", str(router_port), *server, "--stage-tls-ca", str(pki.ca),
              "--stage-tls-cert", str(pki.client_cert), "--stage-tls-key", str(pki.client_key),
              "--transport", "tcp"]),
        Proc([*cmd, "gateway", "--router", f"127.0.0.1:{router_port}", "--port", str(http_port),
              "--router-tls-ca", str(pki.ca), "--router-tls-cert", str(pki.client_cert),
              "--router-tls-key", str(pki.client_key)]),
    ]
    m = TlsMesh(pki, f"127.0.0.1:{router_port}", f"http://127.0.0.1:{http_port}",
                stages[0], stages)
    try:
        deadline = time.monotonic() + 180
        while not _ready(m):
            dead = [p for p in procs if p.proc.poll() is not None]
            assert not dead, "a process exited:\n" + "\n".join(p.output[-3000:] for p in dead)
            assert time.monotonic() < deadline, "never ready:\n" + procs[2].output[-3000:]
            time.sleep(0.5)
        for stage in procs[:2]:
            assert "data plane: TLS on every TCP link" in stage.output
        yield m
    finally:
        for p in reversed(procs):
            p.stop(timeout=30)


def _ready(mesh: TlsMesh) -> bool:
    async def check() -> bool:
        async with RouterClient(mesh.router, _client(mesh)) as client:
            return await client.health("readiness", timeout=2)
    try:
        return asyncio.run(check())
    except grpc.aio.AioRpcError:
        return False


async def _ask(address: str, credentials: grpc.ChannelCredentials | None) -> str:
    async with RouterClient(address, credentials) as client:
        out = await client.complete(messages=QUESTION, temperature=0.0, max_tokens=16,
                                    timeout=60)
        return out.texts[0]


def test_a_client_with_a_certificate_is_served_through_a_tls_stage(mesh: TlsMesh) -> None:
    assert asyncio.run(_ask(mesh.router, _client(mesh))) == "The capital of France is Paris."


@pytest.mark.parametrize("client", ["plaintext", "no-client-cert", "untrusted-client-cert",
                                    "wrong-server-ca"])
def test_other_clients_are_refused(mesh: TlsMesh, client: str) -> None:
    pki = mesh.pki
    credentials = {
        "plaintext": None,
        "no-client-cert": _creds(pki.ca),
        "untrusted-client-cert": _creds(pki.ca, pki.rogue_client_cert, pki.rogue_client_key),
        "wrong-server-ca": _creds(pki.rogue_ca, pki.client_cert, pki.client_key),
    }[client]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(asyncio.wait_for(_ask(mesh.router, credentials), 30))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_gateway_reaches_the_router_over_mutual_tls(mesh: TlsMesh) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 16,
            "messages": QUESTION}
    request = urllib.request.Request(f"{mesh.gateway}/v1/chat/completions",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        reply = json.load(r)
    assert reply["choices"][0]["message"]["content"] == "The capital of France is Paris."


def test_a_router_without_a_client_certificate_never_links_the_stage(mesh: TlsMesh) -> None:
    """The stage requires the router's certificate: a router that has none fails its start-up
    budget with an error naming the stage, and never reports ready."""
    stage = mesh.stage
    router = Proc([sys.executable, "-m", "stagemesh", "router", "--model",
                   str(default_model_dir()), "--stages", ",".join(mesh.stages),
                   "--port", str(free_port()),
                   "--startup-budget", "6", "--stage-tls-ca", str(mesh.pki.ca)])
    try:
        assert router.proc.wait(timeout=60) == 1
    finally:
        router.stop(timeout=10)
    assert f"pipeline did not come up within 6s: stage 0 at {stage}" in router.output
    assert "Traceback" not in router.output


def test_data_plane_tls_needs_the_stages_own_certificate(tmp_path: Path) -> None:
    """--dataplane-tls-ca alone is refused at start with one line naming the flags."""
    out = subprocess.run([sys.executable, "-m", "stagemesh", "stage", "--model",
                          str(default_model_dir()), "--dataplane-tls-ca",
                          str(tmp_path / "ca.pem")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        "stagemesh stage: --dataplane-tls-ca needs the stage's own certificate: --tls-cert "
        "and --tls-key")



def test_server_only_tls_serves_any_client_that_trusts_the_ca(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """TLS without client certificates: a router serving TLS with no client CA answers a
    client that has only the CA, and refuses plaintext."""
    pki = write_pki(tmp_path_factory.mktemp("pki-server-only"))
    stage_port, router_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "stagemesh"]
    model = str(default_model_dir())
    procs = [
        Proc([*cmd, "stage", "--model", model, "--device", "cpu", "--num-blocks", "64",
              "--port", str(stage_port)]),
        Proc([*cmd, "router", "--model", model, "--stages", f"127.0.0.1:{stage_port}",
              "--port", str(router_port), "--tls-cert", str(pki.server_cert),
              "--tls-key", str(pki.server_key)]),
    ]
    router = f"127.0.0.1:{router_port}"
    try:
        deadline = time.monotonic() + 180
        while not _ready(TlsMesh(pki, router, "", "", ())):
            assert all(p.proc.poll() is None for p in procs), procs[1].output[-3000:]
            assert time.monotonic() < deadline, "never ready:\n" + procs[1].output[-3000:]
            time.sleep(0.5)
        assert asyncio.run(_ask(router, _creds(pki.ca))) == "The capital of France is Paris."
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(asyncio.wait_for(_ask(router, None), 30))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for p in reversed(procs):
            p.stop(timeout=30)
