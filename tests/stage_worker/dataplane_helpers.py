"""Shared pieces of the data-plane tests: linked pairs, raw peers, peer processes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from stage_worker.dataplane import (
    DataPlaneConfig,
    TcpListener,
    TcpTransport,
    Transport,
    new_link_token,
)
from stage_worker.dataplane.unix import UnixListener
from stage_worker.dataplane.unix import connect as unix_connect
from stage_worker.dataplane.wire import encode_hello

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[2]
TOKEN = new_link_token()


def call_within(seconds: float, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a thread; fail the test if it has not finished in ``seconds`` (no hang)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"call did not return within {seconds}s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def linked_pair(config: DataPlaneConfig | None = None,
                kind: str = "tcp") -> tuple[TcpTransport, TcpTransport]:
    """(connector end, accepted end) of one authenticated link: over loopback TCP, or
    (`kind` "unix") a Unix-domain socket."""
    config = config or DataPlaneConfig()
    listener: TcpListener | UnixListener = (
        UnixListener(token=TOKEN, config=config) if kind == "unix"
        else TcpListener(HOST, token=TOKEN, config=config))
    with listener:
        accepted: dict[str, Transport] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(10)))
        thread.start()
        if isinstance(listener, UnixListener):
            sender = unix_connect(listener.address, token=TOKEN, timeout_s=10, config=config)
        else:
            sender = TcpTransport.connect(HOST, listener.address[1], token=TOKEN,
                                          timeout_s=10, config=config)
        thread.join(10)
    receiver = accepted["t"]
    assert isinstance(receiver, TcpTransport)
    return sender, receiver


def raw_peer(config: DataPlaneConfig | None = None) -> tuple[socket.socket, TcpTransport]:
    """(a hand-driven connector past the handshake, the accepted end): to send bad bytes."""
    with TcpListener(HOST, token=TOKEN, config=config or DataPlaneConfig()) as listener:
        accepted: dict[str, TcpTransport] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(10)))
        thread.start()
        sock = socket.create_connection(listener.address, timeout=5)
        sock.sendall(encode_hello(TOKEN))
        assert sock.recv(4) == b"SMOK"
        thread.join(5)
    return sock, accepted["t"]


# A connecting stage in its own process. Modes: "one" sends one message then sleeps (to be
# killed); "echo" returns n messages; "source" streams n messages of nbytes, then waits for
# an ack so it never closes before the reader is done.
_PEER_SCRIPT = """
import sys, time, torch
from stage_worker.dataplane import TcpTransport
host, port, token, mode, n, nbytes = sys.argv[1:]
t = TcpTransport.connect(host, int(port), token=bytes.fromhex(token), timeout_s=30)
if mode == "one":
    t.send(5, [torch.arange(4, dtype=torch.int32)])
    time.sleep(60)
elif mode == "echo":
    for step in range(int(n)):
        t.send(step, t.recv(step))
elif mode == "source":
    x = torch.ones(int(nbytes), dtype=torch.uint8)
    for step in range(int(n)):
        t.send(step, [x])
    t.recv(int(n))
"""


@contextlib.contextmanager
def peer_process(listener: TcpListener, mode: str, n: int = 0,
                 nbytes: int = 0) -> Iterator[subprocess.Popen[bytes]]:
    """Start a peer process that connects to ``listener``; kill it on exit."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _PEER_SCRIPT, HOST, str(listener.address[1]), TOKEN.hex(), mode,
         str(n), str(nbytes)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def assert_bit_exact(sent: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(got) == len(sent)
    for a, b in zip(sent, got, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape and b.device.type == "cpu"
        assert b.is_contiguous()
        assert as_bytes(b) == as_bytes(a.cpu())


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infs, denormals included); bool stays 0/1."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel()
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)
