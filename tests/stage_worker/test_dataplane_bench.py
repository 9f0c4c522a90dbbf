"""Loopback benchmark of the TCP data plane against bare sockets (no timed asserts).
``python -m tests.stage_worker.test_dataplane_bench`` prints the full figures."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from stage_worker.dataplane import (
    TcpListener,
)
from tests.stage_worker.dataplane_helpers import HOST, TOKEN, peer_process, random_bits

# ---------------------------------------------------------------- benchmark (no timed asserts)


def bench_round_trip(iters: int, shape: tuple[int, int] = (128, 576)) -> dict[str, float]:
    """Ping-pong of one bf16 [T, H] message with an echoing peer process; RTT in microseconds."""
    x = random_bits(shape, torch.bfloat16)
    warmup = 50
    rtts = []
    with TcpListener(HOST, token=TOKEN) as listener, \
            peer_process(listener, "echo", n=warmup + iters) as proc:
        link = listener.accept(60)
        for step in range(warmup + iters):
            start = time.perf_counter()
            link.send(step, [x])
            link.recv(step, timeout_s=30)
            rtts.append(time.perf_counter() - start)
        link.close()
        proc.wait(30)
    rtts = sorted(rtts[warmup:])
    return {"bytes": x.numel() * x.element_size(), "p50_us": rtts[len(rtts) // 2] * 1e6,
            "p90_us": rtts[len(rtts) * 9 // 10] * 1e6, "mean_us": sum(rtts) / len(rtts) * 1e6}


def bench_throughput(messages: int, nbytes: int = 64 << 20) -> dict[str, float]:
    """A peer process streams ``messages`` + 1 messages of ``nbytes``; the first is warm-up.
    GB/s of payload from the end of the first recv to the end of the last."""
    with TcpListener(HOST, token=TOKEN) as listener, \
            peer_process(listener, "source", n=messages + 1, nbytes=nbytes) as proc:
        link = listener.accept(60)
        link.recv(0, timeout_s=60)  # page faults, socket buffer growth
        start = time.perf_counter()
        for step in range(1, messages + 1):
            link.recv(step, timeout_s=60)
        elapsed = time.perf_counter() - start
        link.send(messages + 1, [])  # the ack the peer waits for
        proc.wait(30)
        link.close()
    return {"message_mib": nbytes / (1 << 20), "gb_per_s": messages * nbytes / elapsed / 1e9,
            "ms_per_message": elapsed / messages * 1e3}


_RAW_ECHO_SCRIPT = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
n, size = int(sys.argv[2]), int(sys.argv[3])
v = memoryview(bytearray(size))
for _ in range(n):
    got = 0
    while got < size:
        got += s.recv_into(v[got:])
    s.sendall(v)
"""


def bench_raw_round_trip(iters: int, nbytes: int = 147456) -> dict[str, float]:
    """The floor: the same ping-pong with bare sockets, reused buffers, no header, no tensors."""
    warmup = 50
    with socket.create_server((HOST, 0)) as server:
        proc = subprocess.Popen([sys.executable, "-c", _RAW_ECHO_SCRIPT,
                                 str(server.getsockname()[1]), str(warmup + iters), str(nbytes)])
        conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out, back = memoryview(bytearray(nbytes)), memoryview(bytearray(nbytes))
    rtts = []
    for _ in range(warmup + iters):
        start = time.perf_counter()
        conn.sendall(out)
        got = 0
        while got < nbytes:
            got += conn.recv_into(back[got:])
        rtts.append(time.perf_counter() - start)
    proc.wait(30)
    conn.close()
    rtts = sorted(rtts[warmup:])
    return {"bytes": nbytes, "p50_us": rtts[len(rtts) // 2] * 1e6}


@pytest.mark.slow
def test_loopback_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    rtt = bench_round_trip(iters=300)
    tput = bench_throughput(messages=4)
    with capsys.disabled():
        print(f"\n[dataplane tcp loopback, 2 processes] {rtt} {tput}")
    assert rtt["p50_us"] > 0 and tput["gb_per_s"] > 0


if __name__ == "__main__":
    print(f"cpus={os.cpu_count()}")
    for shape in ((128, 576), (128, 4096)):
        nbytes = shape[0] * shape[1] * 2
        print(f"round trip bf16 {list(shape)} ({nbytes} B): {bench_round_trip(3000, shape)}; "
              f"bare sockets: {bench_raw_round_trip(3000, nbytes)}")
    print("throughput, 64 MiB messages:", bench_throughput(messages=32))
