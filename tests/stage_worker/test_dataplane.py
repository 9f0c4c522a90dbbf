"""The data plane over real loopback sockets: exact bytes, order, step checks, handshake, limits,
dead peers and timeouts."""

from __future__ import annotations

import inspect
import signal
import socket
import struct
import threading
import time

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
from stage_worker.dataplane.wire import DTYPE_CODES, encode_header
from tests.stage_worker.dataplane_helpers import (
    HOST,
    TOKEN,
    as_bytes,
    assert_bit_exact,
    call_within,
    linked_pair,
    peer_process,
    random_bits,
    raw_peer,
)

# ---------------------------------------------------------------- payload fidelity


@pytest.mark.parametrize("dtype", list(DTYPE_CODES), ids=str)
def test_every_dtype_round_trips_bit_exact(link: tuple[TcpTransport, TcpTransport],
                                           dtype: torch.dtype) -> None:
    sender, receiver = link
    tensors = [random_bits((128, 576), dtype), random_bits((3,), dtype, seed=1)]
    # Sent from another thread: 590 KB (int64) may be more than a link buffers unread.
    sending = threading.Thread(target=sender.send, args=(11, tensors))
    sending.start()
    assert_bit_exact(tensors, receiver.recv(11, timeout_s=5))
    sending.join(5)


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
            TcpTransport.connect(HOST, port, token=TOKEN[:-1] + bytes([TOKEN[-1] ^ 1]), timeout_s=5)
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


def test_a_table_received_before_is_still_checked_against_its_count() -> None:
    """The receiver keeps the tables it decoded; the same table bytes under another count
    are refused all the same."""
    peer, receiver = raw_peer(DataPlaneConfig(max_message_bytes=_LIMIT))
    payload = struct.pack("<4f", 1, 2, 3, 4)
    peer.sendall(_message([(1, (4,), 16)]) + payload)
    assert receiver.recv(0, timeout_s=5)[0].tolist() == [1, 2, 3, 4]
    peer.sendall(_message([(1, (4,), 16)], count=2) + payload)
    with pytest.raises(ProtocolError, match="table"):
        receiver.recv(0, timeout_s=5)
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
