"""The ``unix`` transport: the ``tcp`` transport's stream (its framing, token handshake and
limits: `TcpTransport`) on a Unix-domain stream socket in Linux's abstract namespace.

For the hops between two stages of one host and one network namespace: two processes of
one machine, or two containers of one pod (the router picks it where both report the same
host_id). A message crosses one socket buffer, with no TCP/IP stack or loopback device on
either side: a decode step's activations ([32, 576] fp32, 73 KB) cost each end about half
the CPU they cost over loopback TCP. The feedback link (last stage -> first stage) can be
one too.

A listener binds a fresh random name (`address` "unix:@<name>"), never a path: nothing is
left on disk, and a name is reachable only inside its network namespace. The link token is
checked as on TCP, so another process of the namespace that finds the name is refused.
The bytes never leave the host, so `DataPlaneConfig.tls` does not apply (as for
``cuda_ipc``).
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import sys
import time

from stage_worker.dataplane.config import DataPlaneConfig, LinkSpec, TransportKind, check_token
from stage_worker.dataplane.handshake import present_token, tune_socket
from stage_worker.dataplane.tcp import TcpTransport, accept_linked
from stage_worker.dataplane.transport import (
    LinkListener,
    LinkUnreachableError,
    TransportTimeout,
)

ADDRESS_PREFIX = "unix:@"
_DEFAULT_CONFIG = DataPlaneConfig()


def unavailable_reason() -> str | None:
    """Why this process cannot use the transport (None: it can): abstract Unix-domain
    names are Linux's."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "AF_UNIX"):
        return f"abstract Unix-domain sockets are Linux-only (this is {sys.platform})"
    return None


def name_of(address: str) -> str:
    """The abstract name in an address "unix:@<name>" (ValueError for anything else)."""
    if not address.startswith(ADDRESS_PREFIX) or len(address) == len(ADDRESS_PREFIX):
        raise ValueError(f"a unix data-plane address is {ADDRESS_PREFIX}<name>, got "
                         f"{address!r}")
    return address[len(ADDRESS_PREFIX):]


class UnixListener(LinkListener):
    """Listens on a fresh abstract name for the one peer that presents `token`.

    Raises:
        ValueError: malformed token, or not Linux (`unavailable_reason`).
        OSError: the name cannot be bound.
    """

    def __init__(self, *, token: bytes, config: DataPlaneConfig = _DEFAULT_CONFIG) -> None:
        check_token(token)
        reason = unavailable_reason()
        if reason is not None:
            raise ValueError(f"the unix transport is not available: {reason}")
        self._name = f"stagemesh-dataplane-{secrets.token_hex(12)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind("\0" + self._name)
            self._sock.listen(8)
        except OSError:
            self._sock.close()
            raise
        self._token = token
        self._config = config
        self._closed = False

    @property
    def address(self) -> str:
        """What the connecting stage dials: "unix:@<name>"."""
        return ADDRESS_PREFIX + self._name

    @property
    def spec(self) -> LinkSpec:
        return LinkSpec(kind=TransportKind.UNIX, host=self.address, port=0, token=self._token)

    def accept(self, timeout_s: float) -> TcpTransport:
        return accept_linked(self._sock, self.address, self._token, self._config, timeout_s,
                             lambda: self._closed, tls=False)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):  # wakes an accept() blocked in another thread
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def connect(address: str, *, token: bytes, timeout_s: float,
            config: DataPlaneConfig = _DEFAULT_CONFIG) -> TcpTransport:
    """Connect to a `UnixListener` at `address` ("unix:@<name>") and present the token.

    Raises:
        ValueError: malformed address or token.
        LinkUnreachableError: nothing listens under that name in this network namespace.
        LinkRefusedError: the listener refused the token.
        TransportTimeout: connect or handshake did not finish within `timeout_s`.
    """
    check_token(token)
    name = name_of(address)
    deadline = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + name)
        except TimeoutError as e:
            raise TransportTimeout(f"connect to {address} timed out after {timeout_s}s",
                                   link_closed=True) from e
        except OSError as e:
            raise LinkUnreachableError(
                f"cannot connect to data-plane peer {address}: {e} (a unix link joins two "
                "processes of one host and network namespace)") from e
        tune_socket(sock, config)
        present_token(sock, token, deadline, address)
    except BaseException:
        sock.close()
        raise
    return TcpTransport(sock, config=config, peer=address)
