"""A local mesh as real processes over real sockets: `stagemesh serve`, or one service,
started and stopped from Python (tests and benchmarks use it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

import grpc

from foundation.ports import free_port
from protos.stagemesh.v1 import inference_pb2_grpc

__all__ = ["Mesh", "Proc", "free_port"]

REPO = Path(__file__).resolve().parents[1]


class Proc:
    """A child process whose merged output is collected by a thread (never blocks)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        seen = 0
        while time.monotonic() < deadline:
            while seen < len(self.lines):
                m = rx.search(self.lines[seen])
                seen += 1
                if m:
                    return m
            if self.proc.poll() is not None and seen >= len(self.lines):
                break
            time.sleep(0.05)
        raise TimeoutError(f"no line matching {pattern!r}; output:\n" + self.output[-6000:])

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


class Mesh:
    """`stagemesh serve` with the given flags; `address` is the router's gRPC endpoint.

    `gateway_port`: None (default) runs no HTTP gateway; a port (from `free_port()`) runs
    one there, and `gateway_url` is its base URL ("http://127.0.0.1:PORT", no /v1).
    """

    def __init__(self, *flags: str, timeout: float = 300.0,
                 gateway_port: int | None = None) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "stagemesh", "serve", "--port", str(self.port),
                "--gateway-port", str(gateway_port or 0), "--device", "cpu", *flags]
        self.proc = Proc(argv)
        try:
            self.proc.wait_for(r"stagemesh ready", timeout)
        except BaseException:  # no mesh left behind by a start that failed or was cut
            self.proc.stop(timeout=30)
            raise
        self.address = f"127.0.0.1:{self.port}"
        self.gateway_url = f"http://127.0.0.1:{gateway_port}" if gateway_port else None
        self.pids = {m.group(1): int(m.group(2)) for m in (
            re.match(r"\s+(stage \d+|standby \d+|router|gateway)\s+pid (\d+)", line)
            for line in self.proc.lines) if m}
        # role -> its Prometheus endpoint, as serve printed it
        self.metrics = {m.group(1): m.group(2) for m in (
            re.match(r"\s+(stage \d+|standby \d+|router|gateway)\s+pid .* metrics (\S+)",
                     line) for line in self.proc.lines) if m}

    def pid(self, role: str) -> int:
        """The pid of `role` ("stage 0", "router", "gateway") now: the latest restart's
        (serve restarts a stage or the gateway that dies), else the one it started with."""
        for line in reversed(self.proc.lines):
            m = re.search(rf"stagemesh serve: {role} restarted, pid (\d+)", line)
            if m:
                return int(m.group(1))
        return self.pids[role]

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self.proc.stop()

    def stub(self) -> inference_pb2_grpc.InferenceServiceStub:
        return inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(self.address))
