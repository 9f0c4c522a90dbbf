"""One 2-stage CPU mesh with its HTTP gateway, shared by every gateway test that needs the
model, and standalone gateway processes for flags the shared one does not have."""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from protos.stagemesh.v1 import inference_pb2_grpc
from stagemesh.local_mesh import Mesh, Proc, free_port

MODEL = "SmolLM2-135M-Instruct"
# Admission refuses any prompt over this many queued tokens: a deterministic 429 for the
# error tests. Every other test prompt is far shorter.
MAX_QUEUED_TOKENS = 512


@pytest.fixture(scope="package")
def mesh() -> Iterator[Mesh]:
    with Mesh("--stages", "2", "--num-blocks", "256", "--max-queued-tokens",
              str(MAX_QUEUED_TOKENS), gateway_port=free_port()) as m:
        yield m


@pytest.fixture(scope="package")
def base_url(mesh: Mesh) -> str:
    assert mesh.gateway_url is not None
    return mesh.gateway_url


@pytest.fixture(scope="package")
def stub(mesh: Mesh) -> inference_pb2_grpc.InferenceServiceStub:
    return mesh.stub()


@contextmanager
def gateway(router: str, *flags: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A `stagemesh gateway` process on a free port; yields its base URL once it serves."""
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        proc = Proc([sys.executable, "-m", "stagemesh", "gateway", "--router", router,
                     "--port", "0", "--ready-file", str(ready), *flags], env=env)
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                if proc.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("gateway did not start:\n" + proc.output)
                time.sleep(0.05)
            yield f"http://{ready.read_text().strip()}"
        finally:
            assert proc.stop(timeout=20) == 0, proc.output
