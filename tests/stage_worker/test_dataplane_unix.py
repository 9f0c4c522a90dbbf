"""The ``unix`` transport's own ends: a random abstract name per listener, the token checked
as on TCP, timeouts and closes, addresses checked, what a stage offers. (Its stream is the
TCP transport's: every test of `test_dataplane` that takes the `link` fixture runs over
both.)"""

from __future__ import annotations

import os
import socket
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
    Transport,
    TransportKind,
    TransportTimeout,
    new_link_token,
    open_link,
    open_listener,
)
from stage_worker.dataplane.unix import UnixListener, connect, name_of
from stage_worker.links import offered_transports
from tests.stage_worker.dataplane_helpers import TOKEN, call_within

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/unix"),
                                reason="abstract Unix-domain sockets are Linux's")


def _abstract_names() -> set[str]:
    """The abstract Unix-domain names bound in this network namespace."""
    with open("/proc/net/unix") as f:
        return {line.split()[-1][1:] for line in f if line.split()[-1].startswith("@")}


def test_a_listener_binds_a_fresh_abstract_name_and_nothing_on_disk() -> None:
    with UnixListener(token=TOKEN) as a, UnixListener(token=TOKEN) as b:
        assert a.address != b.address
        for listener in (a, b):
            assert listener.address.startswith("unix:@stagemesh-dataplane-")
            assert name_of(listener.address) in _abstract_names()
            spec = listener.spec
            assert (spec.kind, spec.host, spec.port) == (TransportKind.UNIX, listener.address, 0)
        name = name_of(a.address)
    assert name not in _abstract_names()  # closed: the name is free again
    assert not os.path.exists(name)


def test_wrong_token_refused_then_right_token_accepted(caplog: pytest.LogCaptureFixture) -> None:
    with UnixListener(token=TOKEN) as listener:
        accepted: dict[str, Transport] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(10)))
        thread.start()
        with pytest.raises(LinkRefusedError):
            connect(listener.address, token=new_link_token(), timeout_s=5)
        good = connect(listener.address, token=TOKEN, timeout_s=5)
        thread.join(5)
    with good, accepted["t"] as peer:
        good.send(4, [torch.arange(5, dtype=torch.int32)])
        assert peer.recv(4, timeout_s=5)[0].tolist() == [0, 1, 2, 3, 4]
        for end in (good, peer):  # asked for more than the default send buffer, both ends
            assert end._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) > 212992
    refusals = [r.getMessage() for r in caplog.records if "refused peer" in r.getMessage()]
    assert len(refusals) == 1 and "wrong link token" in refusals[0]


def test_a_peer_that_never_speaks_is_refused_without_blocking_the_listener() -> None:
    with UnixListener(token=TOKEN, config=DataPlaneConfig(handshake_timeout_s=0.3)) as listener:
        accepted: dict[str, Transport] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(10)))
        thread.start()
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        silent.connect("\0" + name_of(listener.address))
        good = connect(listener.address, token=TOKEN, timeout_s=5)
        thread.join(5)
        silent.settimeout(5)
        assert silent.recv(4) in (b"SMNO", b"")  # dropped after its handshake time
        silent.close()
    with good, accepted["t"] as peer:  # the link accepted is the one that spoke
        good.send(1, [torch.tensor([3])])
        assert peer.recv(1, timeout_s=5)[0].item() == 3


def test_accept_times_out_and_a_close_wakes_a_blocked_accept() -> None:
    with UnixListener(token=TOKEN) as listener:
        start = time.monotonic()
        with pytest.raises(TransportTimeout):
            listener.accept(0.2)
        assert 0.15 < time.monotonic() - start < 3
    listener = UnixListener(token=TOKEN)
    threading.Timer(0.2, listener.close).start()
    with pytest.raises(LinkClosedError):
        call_within(5, lambda: listener.accept(30))


def test_a_name_nobody_listens_on_is_unreachable_and_bad_addresses_are_refused() -> None:
    with pytest.raises(LinkUnreachableError, match="one host and network namespace"):
        connect("unix:@stagemesh-dataplane-nobody", token=TOKEN, timeout_s=2)
    for bad in ("127.0.0.1:9", "unix:@", "unix:/tmp/x", "@name"):
        with pytest.raises(ValueError, match="unix:@<name>"):
            connect(bad, token=TOKEN, timeout_s=1)


def test_open_listener_and_open_link_from_specs() -> None:
    with open_listener(LinkSpec(TransportKind.UNIX, "ignored", 0, TOKEN)) as listener:
        spec = listener.spec
        assert spec.kind is TransportKind.UNIX and spec.host.startswith("unix:@")
        accepted: dict[str, Transport] = {}
        thread = threading.Thread(target=lambda: accepted.update(t=listener.accept(10)))
        thread.start()
        with open_link(spec, timeout_s=5) as sender:
            thread.join(5)
            x = torch.randn(32, 576)
            sender.send(3, [x])
            assert torch.equal(accepted["t"].recv(3, timeout_s=5)[0], x)
        with pytest.raises(LinkClosedError):  # the sender's close reaches the receiver
            accepted["t"].recv(4, timeout_s=5)
        accepted["t"].close()


def test_what_a_stage_offers() -> None:
    assert offered_transports("auto", None) == (TransportKind.TCP, TransportKind.UNIX)
    assert offered_transports("unix", None) == (TransportKind.UNIX,)
    assert offered_transports("tcp", None) == (TransportKind.TCP,)
