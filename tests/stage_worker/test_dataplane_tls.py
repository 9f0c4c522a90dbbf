"""TLS on the TCP data plane: bit-exact and ordered as plain TCP, nothing readable on the
wire, and refused (with a clear error, the listener still serving) when one end has no TLS,
when the certificate is not the CA's, or when it does not name the host dialled."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stage_worker.dataplane import (
    DataPlaneConfig,
    LinkRefusedError,
    TcpListener,
    TcpTransport,
    Transport,
)
from stage_worker.dataplane.config import DataPlaneTls
from stage_worker.dataplane.wire import DTYPE_CODES
from tests.stage_worker.dataplane_helpers import (
    HOST,
    TOKEN,
    assert_bit_exact,
    call_within,
    random_bits,
)
from tests.tls_certs import Pki, write_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return write_pki(tmp_path_factory.mktemp("pki"))


def _tls(pki: Pki, ca: Path | None = None) -> DataPlaneConfig:
    return DataPlaneConfig(tls=DataPlaneTls.load(pki.server_cert, pki.server_key,
                                                 ca or pki.ca))


def _pair(listen: DataPlaneConfig, dial: DataPlaneConfig, host: str = HOST,
          via: int | None = None) -> tuple[TcpTransport, TcpTransport]:
    """(connector, accepted) of one link; `via`: dial this port (a proxy) instead."""
    with TcpListener(host, token=TOKEN, config=listen) as listener:
        accepted: dict[str, Transport] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(10)))
        thread.start()
        sender = TcpTransport.connect(host, via or listener.address[1], token=TOKEN,
                                      timeout_s=10, config=dial)
        thread.join(10)
    receiver = accepted["t"]
    assert isinstance(receiver, TcpTransport)
    return sender, receiver


@pytest.fixture
def tls_link(pki: Pki) -> Iterator[tuple[TcpTransport, TcpTransport]]:
    sender, receiver = _pair(_tls(pki), _tls(pki))
    yield sender, receiver
    sender.close()
    receiver.close()


def test_every_dtype_and_a_large_message_round_trip_bit_exact(
        tls_link: tuple[TcpTransport, TcpTransport]) -> None:
    sender, receiver = tls_link
    for i, dtype in enumerate(DTYPE_CODES):
        x = random_bits((33, 7), dtype, seed=i)
        sender.send(i, [x, x[:, ::2]])
        assert_bit_exact([x, x[:, ::2]], receiver.recv(i, timeout_s=10))
    big = random_bits((2048, 1024), torch.bfloat16, seed=99)  # 4 MiB: many TLS records
    threading.Thread(target=lambda: sender.send(100, [big])).start()
    assert_bit_exact([big], receiver.recv(100, timeout_s=30))


def test_small_messages_buffered_by_tls_are_read_with_a_deadline(
        tls_link: tuple[TcpTransport, TcpTransport]) -> None:
    """Several messages arrive in one read; TLS holds the rest decrypted, where poll cannot
    see them: a bounded receive must still find them without waiting."""
    sender, receiver = tls_link
    for step in range(20):
        sender.send(step, [torch.full((3,), step, dtype=torch.int64)])
    for step in range(20):
        got = call_within(5, lambda step=step: receiver.recv(step, timeout_s=2))
        assert got[0].tolist() == [step] * 3


class _Recorder:
    """A TCP forwarder on loopback that keeps every byte it passes (both directions)."""

    def __init__(self, target: int) -> None:
        self.server = socket.create_server((HOST, 0))
        self.port = self.server.getsockname()[1]
        self.seen = bytearray()
        self._target = target
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        upstream = socket.create_connection((HOST, self._target))
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while data := src.recv(1 << 16):
            self.seen += data
            dst.sendall(data)


def _seen_on_the_wire(listen: DataPlaneConfig, dial: DataPlaneConfig) -> bytes:
    secret = b"activations-in-clear" * 64
    with TcpListener(HOST, token=TOKEN, config=listen) as listener:
        recorder = _Recorder(listener.address[1])
        accepted: dict[str, Transport] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(10)))
        thread.start()
        sender = TcpTransport.connect(HOST, recorder.port, token=TOKEN, timeout_s=10,
                                      config=dial)
        thread.join(10)
    sender.send(7, [torch.frombuffer(bytearray(secret), dtype=torch.uint8)])
    assert bytes(accepted["t"].recv(7, timeout_s=10)[0].numpy()) == secret
    sender.close()
    accepted["t"].close()
    return bytes(recorder.seen)


def test_nothing_is_readable_on_the_wire(pki: Pki) -> None:
    plain = _seen_on_the_wire(DataPlaneConfig(), DataPlaneConfig())
    assert b"activations-in-clear" in plain and TOKEN in plain  # the recorder sees all
    encrypted = _seen_on_the_wire(_tls(pki), _tls(pki))
    assert b"activations-in-clear" not in encrypted and TOKEN not in encrypted


def test_a_plain_connector_is_refused_and_the_listener_serves_the_next(pki: Pki) -> None:
    with TcpListener(HOST, token=TOKEN, config=_tls(pki)) as listener:
        accepted: dict[str, Transport] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(20)))
        thread.start()
        with pytest.raises(LinkRefusedError):
            TcpTransport.connect(HOST, listener.address[1], token=TOKEN, timeout_s=10)
        sender = TcpTransport.connect(HOST, listener.address[1], token=TOKEN, timeout_s=10,
                                      config=_tls(pki))
        thread.join(20)
        sender.send(1, [torch.arange(3)])
        assert accepted["t"].recv(1, timeout_s=10)[0].tolist() == [0, 1, 2]


@pytest.mark.parametrize("case", ["plain listener", "untrusted CA", "name not in the cert"])
def test_a_tls_connector_refuses_a_peer_it_cannot_trust(pki: Pki, case: str) -> None:
    listen, dial, host = _tls(pki), _tls(pki), HOST
    if case == "plain listener":
        listen = DataPlaneConfig()
    elif case == "untrusted CA":
        dial = _tls(pki, ca=pki.rogue_ca)
    else:
        host = "127.0.0.2"  # on loopback too, but the certificate names 127.0.0.1 only
    with TcpListener(host, token=TOKEN, config=listen) as listener:
        threading.Thread(target=lambda: _accept_quietly(listener), daemon=True).start()
        with pytest.raises(LinkRefusedError, match="TLS handshake with data-plane peer"):
            TcpTransport.connect(host, listener.address[1], token=TOKEN, timeout_s=10,
                                 config=dial)


def _accept_quietly(listener: TcpListener) -> None:
    with contextlib.suppress(Exception):  # nobody completes the link: the dialer is checked
        listener.accept(10)


def test_unreadable_files_are_named(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot load the CA"):
        DataPlaneTls.load(pki.server_cert, pki.server_key, tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="cannot load"):
        DataPlaneTls.load(pki.ca, pki.server_key, pki.ca)  # a key that is not the cert's
