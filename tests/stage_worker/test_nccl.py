"""The ``nccl`` transport. On CPU: its descriptor, what a stage offers, and the two ends over
a real TCP side link with `LoopbackNccl` standing in for NCCL (the set-up message and its
unique id, messages bit-exact in order, a step mismatch with the streams kept in step, a
wrong or stale token refused, a closed peer seen, the credits bounding what is in flight).
On two GPUs: the same over real NCCL."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from stage_worker.dataplane import (
    LinkClosedError,
    LinkRefusedError,
    ProtocolError,
    StepMismatchError,
    TcpTransport,
    TransportKind,
    TransportTimeout,
    new_link_token,
)
from stage_worker.dataplane.nccl import (
    ENTRY_WIDTH,
    NcclReceiver,
    NcclSender,
    decode_descriptor,
    encode_descriptor,
)
from stage_worker.dataplane.nccl_backend import CupyNccl, NcclBackend, unavailable_reason
from stage_worker.dataplane.nccl_setup import SETUP_VERSION, NcclListener, connect
from stage_worker.dataplane.wire import DTYPE_CODES, MAX_NDIM
from stage_worker.links import DataPlaneAddress, DataPlaneLinks, nccl_device, offered_transports
from tests.stage_worker.dataplane_helpers import HOST, TOKEN, as_bytes, call_within, random_bits
from tests.stage_worker.nccl_loopback import LoopbackNccl

CPU = torch.device("cpu")


def _pair(backend: NcclBackend, device: torch.device = CPU, credits: int = 4,
          devices: tuple[torch.device, torch.device] | None = None
          ) -> tuple[NcclSender, NcclReceiver]:
    """(connector end, listener end) of one link set up over a real TCP side link."""
    send_dev, recv_dev = devices or (device, device)
    with NcclListener(HOST, token=TOKEN, device=recv_dev, credits=credits,
                      backend=backend) as listener:
        accepted: dict[str, NcclReceiver] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(20)))
        thread.start()
        sender = connect(HOST, listener.spec.port, token=TOKEN, timeout_s=20, device=send_dev,
                         backend=backend)
        thread.join(20)
    return sender, accepted["t"]


def _messages() -> list[list[torch.Tensor]]:
    return [
        [random_bits((3, 5), torch.bfloat16, 1), random_bits((7,), torch.float32, 2)],
        [random_bits((), torch.int64, 3), random_bits((2, 0, 4), torch.float16, 4),
         random_bits((4, 3), torch.int32, 5).t()],  # a 0-dim, an empty and a strided one
        [random_bits((1,) * MAX_NDIM, torch.bool, 6), random_bits((9,), torch.uint8, 7),
         random_bits((2, 3), torch.int8, 8)],
        [],
    ]


# --- the descriptor and the offer ---------------------------------------------------------


def test_descriptor_round_trips_and_bounds_the_message() -> None:
    tensors = [torch.zeros(4, 576, dtype=torch.bfloat16), torch.zeros((), dtype=torch.int64),
               torch.zeros([1] * MAX_NDIM, dtype=torch.bool)]
    desc = encode_descriptor(tensors)
    assert desc.tolist()[:1 + ENTRY_WIDTH] == [3, DTYPE_CODES[torch.bfloat16], 2, 4, 576,
                                               0, 0, 0, 0, 0, 0]
    assert decode_descriptor([desc], 1 << 20) == [(t.dtype, tuple(t.shape)) for t in tensors]
    with pytest.raises(ProtocolError, match="limit is 4607"):
        decode_descriptor([desc], 4 * 576 * 2 - 1)
    with pytest.raises(ValueError, match="float64"):
        encode_descriptor([torch.zeros(1, dtype=torch.float64)])
    with pytest.raises(ValueError, match="65 tensors"):
        encode_descriptor([torch.zeros(1)] * 65)


@pytest.mark.parametrize("desc", [
    [], [torch.zeros(3)], [torch.tensor([1, 99] + [0] * 9)],  # not int64; dtype code 99
    [torch.tensor([2, 1, 1, 4] + [0] * 7)],  # says 2 entries, carries 1
    [torch.tensor([1, 1, 1, -4] + [0] * 7)],  # a negative dim
    [torch.tensor([-1])],
], ids=["none", "float", "dtype", "count", "negative", "negative-count"])
def test_bad_descriptors_are_protocol_errors(desc: list[torch.Tensor]) -> None:
    with pytest.raises(ProtocolError):
        decode_descriptor(desc, 1 << 20)


def test_a_cpu_stage_does_not_offer_nccl_and_refuses_it_when_asked() -> None:
    assert unavailable_reason(CPU) == "the stage runs on cpu, not a CUDA device"
    assert offered_transports("auto", None, None) == (TransportKind.TCP, TransportKind.UNIX)
    assert offered_transports("auto", None, torch.device("cuda", 0)) == (
        TransportKind.TCP, TransportKind.UNIX, TransportKind.NCCL)
    assert offered_transports("nccl", None, torch.device("cuda", 0)) == (TransportKind.NCCL,)
    with pytest.raises(ValueError, match="--transport nccl needs a CUDA device"):
        offered_transports("nccl", None, None)
    with pytest.raises(ValueError, match="nccl is not available here: the stage runs on cpu"):
        NcclListener(HOST, token=TOKEN, device=CPU)
    with pytest.raises(LinkRefusedError, match="nccl is not available here"):
        connect(HOST, 1, token=TOKEN, timeout_s=1, device=CPU)
    assert nccl_device(CPU, "auto", tls=False) is None
    assert nccl_device(torch.device("cuda", 0), "tcp", tls=False) is None
    assert nccl_device(torch.device("cuda", 0), "cuda_ipc", tls=False) is None
    links = DataPlaneLinks(DataPlaneAddress(), 5.0)
    with pytest.raises(ValueError, match="does not offer the nccl transport"):
        links.listen_upstream(HOST, TOKEN, 0, TransportKind.NCCL)
    links.close()


class _OldCupyNccl:
    """cupy's `NcclCommunicator` as versions before 14 take the id: a tuple of C chars,
    signed (x86-64) or unsigned (aarch64); cupy 14 takes bytes."""

    def __init__(self, char: str) -> None:
        self.char = char
        self.got: list[object] = []

    def NcclCommunicator(self, ndev: int, comm_id: object, rank: int) -> object:
        if not isinstance(comm_id, tuple):
            raise TypeError("Argument 'commId' has incorrect type")
        low, high = (-128, 127) if self.char == "signed" else (0, 255)
        if not all(low <= b <= high for b in comm_id):
            raise OverflowError("value too large to convert to char")
        self.got.append(comm_id)
        return (ndev, rank)


@pytest.mark.parametrize("char", ["signed", "unsigned"])
def test_the_unique_id_reaches_older_cupy_as_its_chars(char: str) -> None:
    from stage_worker.dataplane.nccl_backend import _communicator

    uid = bytes(range(128, 256))
    fake = _OldCupyNccl(char)
    assert _communicator(fake, uid, 1) == (2, 1)
    want = tuple(b - 256 for b in uid) if char == "signed" else tuple(uid)
    assert fake.got == [want]


def test_auto_with_data_plane_tls_does_not_offer_nccl(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "stagemesh.stage"):
        assert nccl_device(torch.device("cuda", 0), "auto", tls=True) is None
    assert "nccl not offered under auto with data-plane TLS" in caplog.text


# --- the two ends, with NCCL stood in for ------------------------------------------------


def test_set_up_sends_a_fresh_unique_id_as_raw_bytes_and_both_ranks_join_it() -> None:
    backend = LoopbackNccl()
    with NcclListener(HOST, token=TOKEN, device=CPU, credits=3, backend=backend) as listener:
        assert listener.spec.kind is TransportKind.NCCL
        accepted: dict[str, NcclReceiver] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(10)))
        thread.start()
        side = TcpTransport.connect(HOST, listener.spec.port, token=TOKEN, timeout_s=10)
        step, (meta, uid) = side.recv_any(10)  # what the connector reads, by hand
        assert step == 0 and meta.tolist() == [SETUP_VERSION, 3, -1, 128]
        assert uid.dtype == torch.uint8 and as_bytes(uid) == backend.ids[0]
        assert not accepted  # the listener waits for the join before it joins
        side.send(0, [])
        thread.join(10)
    assert isinstance(accepted["t"], NcclReceiver)
    assert [(c.rank, c.aborted) for c in backend.comms] == [(0, False)]
    accepted["t"].close()
    side.close()
    assert backend.comms[0].aborted


def test_a_malformed_set_up_is_refused_by_the_connector() -> None:
    from stage_worker.dataplane.tcp import TcpListener

    with TcpListener(HOST, token=TOKEN) as fake:
        def serve() -> None:
            side = fake.accept(10)
            side.send(0, [torch.tensor([SETUP_VERSION + 1, 4, 0, 128]),
                          torch.zeros(128, dtype=torch.uint8)])
            time.sleep(0.5)  # the connector refuses what it read
            side.close()

        thread = threading.Thread(target=serve)
        thread.start()
        with pytest.raises(ProtocolError, match="version 2"):
            connect(HOST, fake.address[1], token=TOKEN, timeout_s=10, device=CPU,
                    backend=LoopbackNccl())
        thread.join(10)


def test_messages_arrive_bit_exact_in_order() -> None:
    backend = LoopbackNccl()
    sender, receiver = _pair(backend)
    with sender, receiver:
        messages = _messages()
        for step, tensors in enumerate(messages):
            sender.send(10 + step, tensors)
        for step, tensors in enumerate(messages):
            got = receiver.recv(10 + step, timeout_s=10)
            assert len(got) == len(tensors)
            for a, b in zip(tensors, got, strict=True):
                assert (b.dtype, b.shape, b.device) == (a.dtype, a.shape, CPU)
                assert as_bytes(b) == as_bytes(a)
        rank0, rank1 = sorted(backend.comms, key=lambda c: c.rank)
        assert (rank0.rank, rank1.rank) == (0, 1)
        # one NCCL op per non-empty tensor; each message ordered after and before the caller
        assert rank1.sent == rank0.received == 7
        assert rank1.orders == rank0.orders == 2 * len(messages)


def test_a_step_mismatch_names_both_ids_and_the_next_message_still_arrives() -> None:
    sender, receiver = _pair(LoopbackNccl())
    with sender, receiver:
        first, second = random_bits((4, 8), torch.bfloat16, 1), random_bits((3,), torch.int64, 2)
        sender.send(7, [first])
        sender.send(8, [second])
        with pytest.raises(StepMismatchError) as info:
            receiver.recv(6, timeout_s=10)
        assert (info.value.expected_step_id, info.value.received_step_id) == (6, 7)
        assert "expected step 6, received step 7" in str(info.value)
        (got,) = receiver.recv(8, timeout_s=10)  # the payload of step 7 was consumed
        assert as_bytes(got) == as_bytes(second)
        assert not receiver.closed


def test_a_wrong_or_stale_token_is_refused_and_the_listener_still_accepts() -> None:
    backend = LoopbackNccl()
    old, new = new_link_token(), new_link_token()  # the previous epoch's token, this one's
    with NcclListener(HOST, token=new, device=CPU, backend=backend) as listener:
        accepted: dict[str, NcclReceiver] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(20)))
        thread.start()
        with pytest.raises(LinkRefusedError):
            connect(HOST, listener.spec.port, token=old, timeout_s=10, device=CPU,
                    backend=backend)
        assert backend.ids == [] and backend.comms == []  # refused before any set-up
        sender = connect(HOST, listener.spec.port, token=new, timeout_s=10, device=CPU,
                         backend=backend)
        thread.join(20)
    with sender, accepted["t"] as receiver:
        sender.send(1, [torch.arange(3)])
        assert receiver.recv(1, timeout_s=10)[0].tolist() == [0, 1, 2]


def test_a_closed_sender_wakes_a_blocked_receive_and_aborts_both_communicators() -> None:
    backend = LoopbackNccl()
    sender, receiver = _pair(backend)
    closer = threading.Timer(0.3, sender.close)
    closer.start()
    with pytest.raises(LinkClosedError):
        call_within(10, lambda: receiver.recv(1))
    closer.join(5)
    assert receiver.closed
    assert all(c.aborted for c in backend.comms)
    with pytest.raises(LinkClosedError):
        sender.send(2, [torch.zeros(1)])


def test_a_closed_receiver_fails_the_next_send() -> None:
    backend = LoopbackNccl()
    sender, receiver = _pair(backend)
    credits_ended = sender._credits_ended

    def late_credits_ended() -> None:  # the credit reader is slow to close: the send still
        time.sleep(0.3)                # aborts the communicator before it reports the close
        credits_ended()

    sender._credits_ended = late_credits_ended  # type: ignore[method-assign]
    receiver.close()

    def send_until_it_fails() -> None:
        for step in range(100):  # the credit reader sees EOF and closes the sender
            sender.send(step, [torch.zeros(4)], timeout_s=5)
            time.sleep(0.05)

    with pytest.raises(LinkClosedError):
        call_within(10, send_until_it_fails)
    assert sender.closed and all(c.aborted for c in backend.comms)


def test_credits_bound_the_messages_in_flight() -> None:
    sender, receiver = _pair(LoopbackNccl(), credits=2)
    with sender, receiver:
        sender.send(0, [torch.zeros(2)], timeout_s=5)
        sender.send(1, [torch.ones(2)], timeout_s=5)
        started = time.monotonic()
        with pytest.raises(TransportTimeout, match="every nccl credit is in flight") as info:
            sender.send(2, [torch.full((2,), 2.0)], timeout_s=0.3)
        assert not info.value.link_closed and time.monotonic() - started >= 0.3
        assert receiver.recv(0, timeout_s=5)[0].tolist() == [0.0, 0.0]  # returns a credit
        sender.send(2, [torch.full((2,), 2.0)], timeout_s=5)
        assert receiver.recv(1, timeout_s=5)[0].tolist() == [1.0, 1.0]
        assert receiver.recv(2, timeout_s=5)[0].tolist() == [2.0, 2.0]
        assert not sender.closed


def test_a_credit_never_given_out_ends_the_link(caplog: pytest.LogCaptureFixture) -> None:
    backend = LoopbackNccl()
    sender, receiver = _pair(backend)
    with sender, receiver, caplog.at_level(logging.INFO):
        receiver._side.send(3, [])  # nccl credits are all for step 0
        deadline = time.monotonic() + 10
        while not sender.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(LinkClosedError, match=r"nccl link to \S+ is closed"):
            sender.send(1, [torch.zeros(1)], timeout_s=5)
        rank0, rank1 = sorted(backend.comms, key=lambda c: c.rank)
        assert rank1.aborted and not rank0.aborted  # the receiver sees EOF when it reads
    assert "nccl credit for step 3 with 0 tensors" in caplog.text


def test_links_are_one_way() -> None:
    sender, receiver = _pair(LoopbackNccl())
    with sender, receiver:
        with pytest.raises(Exception, match="connector to the listener only"):
            receiver.send(0, [])
        with pytest.raises(Exception, match="connector to the listener only"):
            sender.recv(0)


# --- two GPUs, real NCCL ------------------------------------------------------------------


@pytest.mark.gpu
def test_two_gpus_bit_exact_in_order_over_real_nccl() -> None:
    """Needs two CUDA devices (NCCL refuses two ranks on one GPU) and cupy with NCCL: skipped
    on one GPU. Both ranks run in this process, on cuda:0 and cuda:1."""
    if torch.cuda.device_count() < 2 or unavailable_reason(torch.device("cuda", 0)):
        pytest.skip("needs two CUDA devices and cupy's NCCL")
    devices = (torch.device("cuda", 0), torch.device("cuda", 1))
    sender, receiver = _pair(CupyNccl(), devices=devices)
    with sender, receiver:
        messages = [[t.to(devices[0]) for t in m] for m in _messages()]
        for step, tensors in enumerate(messages):
            sender.send(step, tensors)
        sender.send(99, [messages[0][0]])
        for step, tensors in enumerate(messages):
            got = receiver.recv(step, timeout_s=30)
            for a, b in zip(tensors, got, strict=True):
                assert b.device == devices[1] and as_bytes(b.cpu()) == as_bytes(a.cpu())
        with pytest.raises(StepMismatchError):
            receiver.recv(98, timeout_s=30)
        torch.cuda.synchronize(devices[1])
