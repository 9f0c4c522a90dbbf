"""The data plane over real loopback sockets: exact bytes, order, step checks, handshake, limits,
dead peers and timeouts. Run ``python -m tests.stage_worker.test_dataplane`` for the benchmark."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stage_worker.dataplane import (
    DataPlaneConfig,
    LinkClosedError,
    LinkRefusedError,
    LinkSpec,
    LinkUnreachableError,
    ProtocolError,
    StepMismatchError,
    TcpListener,
    TcpTransport,
    Transport,
    TransportKind,
    TransportTimeout,
    new_link_token,
    open_link,
    open_listener,
)
from stage_worker.dataplane.wire import DTYPE_CODES, encode_header, encode_hello

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


def linked_pair(config: DataPlaneConfig | None = None) -> tuple[TcpTransport, TcpTransport]:
    """(connector end, accepted end) of one authenticated loopback link."""
    config = config or DataPlaneConfig()
    with TcpListener(HOST, token=TOKEN, config=config) as listener:
        accepted: dict[str, Transport] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(10)))
        thread.start()
        sender = TcpTransport.connect(HOST, listener.address[1], token=TOKEN, timeout_s=10,
                                      config=config)
        thread.join(10)
    receiver = accepted["t"]
    assert isinstance(receiver, TcpTransport)
    return sender, receiver


@pytest.fixture
def link() -> Iterator[tuple[TcpTransport, TcpTransport]]:
    sender, receiver = linked_pair()
    yield sender, receiver
    sender.close()
    receiver.close()


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


# ---------------------------------------------------------------- payload fidelity


@pytest.mark.parametrize("dtype", list(DTYPE_CODES), ids=str)
def test_every_dtype_round_trips_bit_exact(link: tuple[TcpTransport, TcpTransport],
                                           dtype: torch.dtype) -> None:
    sender, receiver = link
    tensors = [random_bits((128, 576), dtype), random_bits((3,), dtype, seed=1)]
    sender.send(11, tensors)
    assert_bit_exact(tensors, receiver.recv(11, timeout_s=5))


def test_awkward_tensors_in_one_message(link: tuple[TcpTransport, TcpTransport]) -> None:
    sender, receiver = link
    base = random_bits((6, 8), torch.bfloat16)
    tensors = [
        base.t(),                                     # transposed bf16
        base[::2, 1::3],                              # strided slice
        torch.arange(5).expand(4, 5),                 # stride-0 broadcast
        torch.tensor(2.5, dtype=torch.float16),       # 0-dim
        torch.empty(0, 4096, dtype=torch.bfloat16),   # empty
        torch.empty(0, dtype=torch.int32),
        torch.ones(1, 1, 1, 1, 1, 1, 1, 2, dtype=torch.uint8),  # the 8-dim limit
        torch.randn(3, 4, requires_grad=True),        # needs detach
        random_bits((7,), torch.bool),
    ]
    sender.send(0, tensors)
    assert_bit_exact(tensors, receiver.recv(0, timeout_s=5))
    sender.send(1, [])  # a message may carry no tensors
    assert receiver.recv(1, timeout_s=5) == []


def test_order_preserved_over_many_messages(link: tuple[TcpTransport, TcpTransport]) -> None:
    sender, receiver = link
    steps = [3 * i + (i % 2) for i in range(400)]  # not consecutive: micro-batches interleave

    def produce() -> None:
        for i, step in enumerate(steps):
            sender.send(step, [torch.full((i % 7 + 1, 64), i, dtype=torch.int32),
                               torch.tensor(step)])

    producer = threading.Thread(target=produce)
    producer.start()
    for i, step in enumerate(steps):
        values, echoed = receiver.recv(step, timeout_s=5)
        assert values.shape == (i % 7 + 1, 64) and bool((values == i).all())
        assert int(echoed) == step
    producer.join(5)


def test_full_duplex_on_one_link(link: tuple[TcpTransport, TcpTransport]) -> None:
    a, b = link
    big = random_bits((4 << 20,), torch.uint8)  # 4 MiB each way: both send buffers fill up

    def side(me: Transport, tag: int) -> None:
        sending = threading.Thread(target=lambda: me.send(tag, [big]))
        sending.start()
        assert_bit_exact([big], me.recv(1 - tag, timeout_s=10))
        sending.join(10)

    other = threading.Thread(target=side, args=(b, 1))
    other.start()
    side(a, 0)
    other.join(10)
    assert not other.is_alive()


# ---------------------------------------------------------------- the step contract


def test_step_mismatch_names_both_ids(link: tuple[TcpTransport, TcpTransport]) -> None:
    sender, receiver = link
    sender.send(41, [torch.zeros(2)])
    with pytest.raises(StepMismatchError, match=r"expected step 42.*received step 41") as info:
        receiver.recv(42, timeout_s=5)
    assert (info.value.expected_step_id, info.value.received_step_id) == (42, 41)
    sender.send(43, [torch.ones(2)])  # the mismatched message was consumed; framing holds
    assert_bit_exact([torch.ones(2)], receiver.recv(43, timeout_s=5))


# ---------------------------------------------------------------- handshake


def test_wrong_token_refused_then_right_token_accepted(caplog: pytest.LogCaptureFixture) -> None:
    with TcpListener(HOST, token=TOKEN) as listener:
        port = listener.address[1]
        accepted: dict[str, Transport] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(10)))
        thread.start()
        with pytest.raises(LinkRefusedError):
            TcpTransport.connect(HOST, port, token=new_link_token(), timeout_s=5)
        with pytest.raises(LinkRefusedError):  # a right prefix is not enough
            TcpTransport.connect(HOST, port, token=TOKEN[:-1] + b"\0", timeout_s=5)
        good = TcpTransport.connect(HOST, port, token=TOKEN, timeout_s=5)
        thread.join(5)
    with good, accepted["t"] as peer:
        good.send(0, [torch.tensor([7])])
        assert peer.recv(0, timeout_s=5)[0].item() == 7
    refusals = [r for r in caplog.records if "refused peer" in r.getMessage()]
    assert len(refusals) == 2 and all("wrong link token" in r.getMessage() for r in refusals)


def test_garbage_and_silent_peers_are_refused_without_blocking_the_listener() -> None:
    config = DataPlaneConfig(handshake_timeout_s=0.3)
    with TcpListener(HOST, token=TOKEN, config=config) as listener:
        accepted: dict[str, Transport] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(10)))
        thread.start()
        silent = socket.create_connection(listener.address, timeout=5)
        http = socket.create_connection(listener.address, timeout=5)
        http.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        good = TcpTransport.connect(HOST, listener.address[1], token=TOKEN, timeout_s=5)
        thread.join(5)
        assert http.recv(4) in (b"SMNO", b"")
        silent.close()
        http.close()
    good.close()
    accepted["t"].close()


def test_accept_times_out_without_a_peer() -> None:
    with TcpListener(HOST, token=TOKEN) as listener:
        start = time.monotonic()
        with pytest.raises(TransportTimeout):
            listener.accept(0.2)
        assert 0.15 < time.monotonic() - start < 3


def test_closing_the_listener_wakes_a_blocked_accept() -> None:
    listener = TcpListener(HOST, token=TOKEN)
    threading.Timer(0.2, listener.close).start()
    with pytest.raises(LinkClosedError):
        call_within(5, lambda: listener.accept(30))


def test_connect_to_nothing_is_unreachable() -> None:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        free_port = probe.getsockname()[1]
    with pytest.raises(LinkUnreachableError):
        TcpTransport.connect(HOST, free_port, token=TOKEN, timeout_s=2)


def test_listener_binds_the_given_address_and_has_no_wildcard_default() -> None:
    assert inspect.signature(TcpListener).parameters["host"].default is inspect.Parameter.empty
    with TcpListener(HOST, token=TOKEN) as listener:
        assert listener.address[0] == HOST and listener.address[1] > 0
        assert listener._sock.getsockname()[0] == HOST


# ---------------------------------------------------------------- dead peers and timeouts


def test_peer_close_raises_link_closed(link: tuple[TcpTransport, TcpTransport]) -> None:
    sender, receiver = link
    sender.close()
    with pytest.raises(LinkClosedError):
        call_within(5, lambda: receiver.recv(0))  # no timeout: EOF alone must end the wait
    assert receiver.closed
    with pytest.raises(LinkClosedError):
        sender.send(0, [torch.zeros(1)])


def test_local_close_wakes_a_blocked_recv(link: tuple[TcpTransport, TcpTransport]) -> None:
    _, receiver = link
    threading.Timer(0.2, receiver.close).start()
    with pytest.raises(LinkClosedError):
        call_within(5, lambda: receiver.recv(0))


def test_killed_peer_process_raises_link_closed() -> None:
    with TcpListener(HOST, token=TOKEN) as listener, peer_process(listener, "one") as proc:
        receiver = listener.accept(60)
        assert receiver.recv(5, timeout_s=30)[0].tolist() == [0, 1, 2, 3]
        proc.send_signal(signal.SIGKILL)
        with pytest.raises(LinkClosedError):
            call_within(10, lambda: receiver.recv(6))


def test_recv_timeout_leaves_an_idle_link_usable(link: tuple[TcpTransport, TcpTransport]) -> None:
    sender, receiver = link
    start = time.monotonic()
    with pytest.raises(TransportTimeout) as info:
        receiver.recv(0, timeout_s=0.2)
    assert 0.15 < time.monotonic() - start < 3
    assert not info.value.link_closed and not receiver.closed
    sender.send(0, [torch.ones(3)])
    assert_bit_exact([torch.ones(3)], receiver.recv(0, timeout_s=5))


def test_recv_timeout_mid_message_closes_the_link() -> None:
    peer, receiver = raw_peer()
    header = encode_header(0, [torch.zeros(1024)], 1 << 20)
    peer.sendall(header + b"\0" * 100)  # header and part of the payload, then silence
    with pytest.raises(TransportTimeout) as info:
        receiver.recv(0, timeout_s=0.3)
    assert info.value.link_closed and receiver.closed
    peer.close()


def test_recv_timeout_inside_a_header_keeps_the_link_framed() -> None:
    peer, receiver = raw_peer()
    x = torch.arange(6, dtype=torch.int64)
    message = encode_header(4, [x], 1 << 20) + as_bytes(x)
    peer.sendall(message[:30])  # the prefix and part of the table
    with pytest.raises(TransportTimeout) as info:
        receiver.recv(4, timeout_s=0.2)
    assert not info.value.link_closed and not receiver.closed
    peer.sendall(message[30:])
    assert_bit_exact([x], receiver.recv(4, timeout_s=5))
    receiver.close()
    peer.close()


def test_send_timeout_when_the_peer_does_not_read(link: tuple[TcpTransport, TcpTransport]) -> None:
    sender, _ = link
    with pytest.raises(TransportTimeout) as info:
        for step in range(64):  # fills both socket buffers; the peer never reads
            sender.send(step, [torch.empty(16 << 20, dtype=torch.uint8)], timeout_s=0.3)
    assert info.value.link_closed == sender.closed


# ---------------------------------------------------------------- limits and bad bytes

_LIMIT = 1 << 20
_PREFIX = struct.Struct("<4sBBHIQ")


def _message(entries: list[tuple[int, tuple[int, ...], int]], *, magic: bytes = b"SMDP",
             version: int = 1, flags: int = 0, count: int | None = None,
             table_bytes: int | None = None, trailing: bytes = b"") -> bytes:
    """A header built from the documented layout by hand (no payload follows it)."""
    table = b"".join(struct.pack(f"<BB{len(s)}QQ", code, len(s), *s, n) for code, s, n in entries)
    return _PREFIX.pack(magic, version, flags, len(entries) if count is None else count,
                        len(table) if table_bytes is None else table_bytes, 0) + table + trailing


@pytest.mark.parametrize("raw", [
    _message([], magic=b"EVIL"),
    _message([], version=2),
    _message([], flags=1),
    _message([], count=65, table_bytes=0),
    _message([], count=1, table_bytes=1 << 30),                 # would allocate a huge table
    _message([(1, (1,) * 9, 4)]),                               # ndim 9
    _message([(0, (4,), 16)]),                                  # dtype code 0 is never used
    _message([(99, (4,), 16)]),                                 # unknown dtype code
    _message([(1, (4,), 17)]),                                  # nbytes does not fit shape
    _message([(1, (1024, 1024), 4 << 20)]),                     # 4 MiB > the 1 MiB limit
    _message([(1, (0, 1 << 62), 0)]),                           # empty but absurd dims
    _message([(7, (1 << 19,), 1 << 19)] * 3),                   # sum over the limit
    _message([(1, (4,), 16)], table_bytes=10),                  # table cut short
    _message([(1, (4,), 16)], table_bytes=30, trailing=bytes(12)),  # table has spare bytes
], ids=["magic", "version", "flags", "count", "table", "ndim", "code0", "code99", "nbytes",
        "oversize", "dims", "sum", "table_short", "table_long"])
def test_malformed_or_oversize_headers_are_refused(raw: bytes) -> None:
    peer, receiver = raw_peer(DataPlaneConfig(max_message_bytes=_LIMIT))
    peer.sendall(raw)
    # ProtocolError at once (not a timeout: nothing waits for a payload it would not accept).
    with pytest.raises(ProtocolError):
        receiver.recv(0, timeout_s=5)
    assert receiver.closed
    peer.close()


def test_send_side_limits_leave_the_link_usable() -> None:
    sender, receiver = linked_pair(DataPlaneConfig(max_message_bytes=_LIMIT))
    with pytest.raises(ValueError, match="float64"):
        sender.send(0, [torch.zeros(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match="65 tensors"):
        sender.send(0, [torch.zeros(1)] * 65)
    with pytest.raises(ValueError, match="9 dims"):
        sender.send(0, [torch.zeros((1,) * 9)])
    with pytest.raises(ValueError, match="limit"):
        sender.send(0, [torch.zeros(_LIMIT, dtype=torch.uint8)])
    for bad_step in (-1, 1 << 64):
        with pytest.raises(ValueError, match="step_id"):
            sender.send(bad_step, [])
    sender.send((1 << 64) - 1, [torch.ones(1)])
    assert_bit_exact([torch.ones(1)], receiver.recv((1 << 64) - 1, timeout_s=5))
    sender.close()
    receiver.close()


def test_header_layout_is_the_documented_one() -> None:
    header = encode_header(9, [torch.zeros(2, 3, dtype=torch.bfloat16)], 1 << 20)
    table = struct.pack("<BB2QQ", 3, 2, 2, 3, 12)
    assert header == _PREFIX.pack(b"SMDP", 1, 0, 1, len(table), 9) + table


# ---------------------------------------------------------------- specs and the factory


def test_link_spec_validates_and_hides_the_token() -> None:
    spec = LinkSpec(TransportKind.TCP, HOST, 1234, TOKEN)
    assert TOKEN.hex() not in repr(spec) and str(TOKEN) not in repr(spec)
    for bad in (dict(token=b"short"), dict(port=70000), dict(host="")):
        with pytest.raises(ValueError):
            LinkSpec(**{"kind": TransportKind.TCP, "host": HOST, "port": 1, "token": TOKEN,
                        **bad})


def test_open_listener_and_open_link_from_specs() -> None:
    with open_listener(LinkSpec(TransportKind.TCP, HOST, 0, TOKEN)) as listener:
        spec = listener.spec
        assert spec.port > 0 and spec.token == TOKEN
        accepted: dict[str, Transport] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(10)))
        thread.start()
        with open_link(spec, timeout_s=5) as sender:
            thread.join(5)
            sender.send(3, [torch.arange(3)])
            assert accepted["t"].recv(3, timeout_s=5)[0].tolist() == [0, 1, 2]
        accepted["t"].close()
    with pytest.raises(ValueError, match="port 0"):
        open_link(LinkSpec(TransportKind.TCP, HOST, 0, TOKEN), timeout_s=1)


@pytest.mark.gpu
def test_cuda_tensors_travel_over_tcp(link: tuple[TcpTransport, TcpTransport]) -> None:
    sender, receiver = link
    x = random_bits((128, 576), torch.bfloat16).cuda()
    sender.send(0, [x, x[:, ::2]])
    assert_bit_exact([x, x[:, ::2]], receiver.recv(0, timeout_s=5))


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
