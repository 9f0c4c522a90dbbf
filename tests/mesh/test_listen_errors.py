"""A service (stage, router, gateway) whose port is taken ends with one line naming the
address, exit status 1, and no process left behind (a stage's TP ranks included); also
when the port's holder set SO_REUSEPORT, as a gRPC server does by default, beside which a
reuse-port bind would succeed and share the port's connections with it. The same for a
taken --metrics-port."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from stagemesh.local_mesh import Proc, free_port
from tests.default_model import default_model_dir

pytestmark = pytest.mark.slow


def _fails_alone(args: list[str]) -> str:
    """`stagemesh ARGS` must exit 1 with no traceback and leave no process of its group
    (its TP ranks included); returns its output."""
    proc = Proc([sys.executable, "-m", "stagemesh", *args])
    try:
        assert proc.proc.wait(timeout=120) == 1
        with pytest.raises(ProcessLookupError):  # its process group is empty
            os.killpg(proc.proc.pid, 0)
    finally:
        proc.stop(timeout=10)
    assert "Traceback" not in proc.output, proc.output
    return proc.output


@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "reuse-port"])
@pytest.mark.parametrize("role", ["stage", "router", "gateway"])
def test_a_taken_port_is_a_one_line_error(role: str, reuse_port: bool) -> None:
    with socket.socket() as taken:
        if reuse_port:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        model = str(default_model_dir())
        flags = {"stage": ["--model", model, "--device", "cpu", "--num-blocks", "16",
                           "--tp", "2"],
                 "router": ["--model", model, "--stages", "127.0.0.1:1"],
                 "gateway": ["--tokenizer", model, "--router", "127.0.0.1:1"]}[role]
        output = _fails_alone([role, "--port", str(port), *flags])
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in output


@pytest.mark.parametrize("role", ["stage", "router"])
def test_a_taken_metrics_port_is_a_one_line_error(role: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        model = str(default_model_dir())
        flags = {"stage": ["--device", "cpu", "--num-blocks", "16", "--tp", "2"],
                 "router": ["--stages", "127.0.0.1:1"]}[role]
        output = _fails_alone([role, "--model", model, "--port", str(free_port()),
                               "--metrics-port", str(port), *flags])
    assert f"--metrics-port: cannot listen on 127.0.0.1:{port}" in output
