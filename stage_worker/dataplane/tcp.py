"""The ``tcp`` transport: one TCP stream per link, header + raw bytes (see `wire`), token handshake.

For CPU-only runs, CI, and hops with no GPU path. The stage that receives listens
(`TcpListener`), the stage that sends connects (`TcpTransport.connect`); once linked, the
stream is full duplex (the last stage also sends sampled ids back to stage 0 on it).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import select
import socket
import threading
import time
from collections.abc import Sequence

import torch

from stage_worker.dataplane.config import (
    DataPlaneConfig,
    LinkSpec,
    TransportKind,
    check_token,
)
from stage_worker.dataplane.socket_io import DeadlineExpiredError, recv_exact, send_all
from stage_worker.dataplane.transport import (
    LinkClosedError,
    LinkListener,
    LinkRefusedError,
    LinkUnreachableError,
    ProtocolError,
    StepMismatchError,
    Transport,
    TransportError,
    TransportTimeout,
)
from stage_worker.dataplane.wire import (
    HELLO,
    MAX_TABLE_BYTES,
    PREFIX,
    VERDICT_BYTES,
    VERDICT_OK,
    VERDICT_REFUSED,
    byte_view,
    decode_hello,
    decode_prefix,
    decode_table,
    encode_header,
    encode_hello,
    wire_tensor,
)

logger = logging.getLogger(__name__)

_DEFAULT_CONFIG = DataPlaneConfig()


class TcpTransport(Transport):
    """A linked, authenticated TCP stream implementing the `Transport` contract.

    Obtain one from `TcpTransport.connect` or `TcpListener.accept`; the constructor takes a
    socket whose handshake is already done. Received tensors are on CPU; CUDA tensors passed to
    ``send`` are copied to host memory first.
    """

    def __init__(self, sock: socket.socket, *, config: DataPlaneConfig, peer: str) -> None:
        sock.settimeout(None)  # blocking for life; deadlines are polls (see socket_io)
        self._sock = sock
        self._config = config
        self.peer = peer
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        # One poll object per direction: a poll object must not be polled by two threads.
        self._recv_poller = select.poll()
        self._recv_poller.register(sock, select.POLLIN)
        self._send_poller = select.poll()
        self._send_poller.register(sock, select.POLLOUT)
        # Reused header buffers: the prefix and the largest possible table.
        self._prefix_view = memoryview(bytearray(PREFIX.size))
        self._table_view = memoryview(bytearray(MAX_TABLE_BYTES))

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        *,
        token: bytes,
        timeout_s: float,
        config: DataPlaneConfig = _DEFAULT_CONFIG,
    ) -> TcpTransport:
        """Connect to a `TcpListener` and present the link token.

        Args:
            host: the listener's address.
            port: the listener's port.
            token: the per-link token the listener expects.
            timeout_s: upper bound on connecting plus the handshake.
            config: local limits of this end.

        Returns:
            The linked transport.

        Raises:
            ValueError: malformed token.
            LinkUnreachableError: nothing accepts connections at ``host:port``.
            LinkRefusedError: the listener refused the token (or is not a data-plane listener).
            TransportTimeout: connect or handshake did not finish within ``timeout_s``.
        """
        check_token(token)
        peer = f"{host}:{port}"
        deadline = time.monotonic() + timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except TimeoutError as e:
            raise TransportTimeout(f"connect to {peer} timed out after {timeout_s}s",
                                   link_closed=True) from e
        except OSError as e:
            raise LinkUnreachableError(f"cannot connect to data-plane peer {peer}: {e}") from e
        try:
            _tune(sock, config)
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            sock.sendall(encode_hello(token))
            verdict = _recv_small(sock, VERDICT_BYTES)
        except TimeoutError as e:
            sock.close()
            raise TransportTimeout(f"handshake with {peer} timed out after {timeout_s}s",
                                   link_closed=True) from e
        except (OSError, LinkClosedError) as e:
            sock.close()
            raise LinkRefusedError(f"data-plane peer {peer} closed the handshake: {e}") from e
        if verdict != VERDICT_OK:
            sock.close()
            raise LinkRefusedError(f"data-plane peer {peer} refused the link token")
        return cls(sock, config=config, peer=peer)

    @property
    def closed(self) -> bool:
        return self._closed

    def send(
        self, step_id: int, tensors: Sequence[torch.Tensor], timeout_s: float | None = None
    ) -> None:
        wire = [wire_tensor(t) for t in tensors]
        header = encode_header(step_id, wire, self._config.max_message_bytes)
        # One sendmsg for header + every payload (scatter-gather), unless the kernel splits it.
        buffers: list[bytes | memoryview] = [header, *(byte_view(t) for t in wire)]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._send_lock:
            self._raise_if_closed()
            try:
                send_all(self._sock, buffers, deadline, self._send_poller)
            except DeadlineExpiredError as e:
                if e.transferred == 0:
                    raise TransportTimeout(
                        f"send of step {step_id} to {self.peer}: peer not reading for "
                        f"{timeout_s}s", link_closed=False) from None
                self.close()  # half a message is on the wire: the stream is unframed now
                raise TransportTimeout(
                    f"send of step {step_id} to {self.peer} timed out mid-message after "
                    f"{timeout_s}s; link closed", link_closed=True) from None
            except BaseException:
                self.close()
                raise

    def recv(self, expected_step_id: int, timeout_s: float | None = None) -> list[torch.Tensor]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._recv_lock:
            self._raise_if_closed()
            try:
                step_id, tensors = self._read_message(deadline, timeout_s)
            except TransportTimeout as e:
                if e.link_closed:
                    self.close()
                raise
            except BaseException:  # protocol error, dead peer, interrupt: stream unframed
                self.close()
                raise
        if step_id != expected_step_id:
            raise StepMismatchError(expected_step_id, step_id)
        return tensors

    def _read_message(
        self, deadline: float | None, timeout_s: float | None
    ) -> tuple[int, list[torch.Tensor]]:
        """Read one whole message: prefix, table, then each payload into its tensor."""
        sock, poller = self._sock, self._recv_poller
        try:
            recv_exact(sock, self._prefix_view, deadline, poller)
        except DeadlineExpiredError as e:
            raise TransportTimeout(
                f"no data-plane message from {self.peer} within {timeout_s}s",
                link_closed=e.transferred > 0) from None
        try:
            prefix = decode_prefix(self._prefix_view)
            table = self._table_view[: prefix.table_bytes]
            recv_exact(sock, table, deadline, poller)
            headers = decode_table(table, prefix.count, self._config.max_message_bytes)
            # Limits are checked: allocate, then receive each payload into its tensor's memory.
            tensors = [torch.empty(h.shape, dtype=h.dtype) for h in headers]
            for t in tensors:
                recv_exact(sock, byte_view(t), deadline, poller)
        except DeadlineExpiredError:
            raise TransportTimeout(
                f"data-plane message from {self.peer} incomplete after {timeout_s}s; "
                "link closed", link_closed=True) from None
        return prefix.step_id, tensors

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        # shutdown first: it wakes a thread blocked in recv/send/poll on this socket.
        with contextlib.suppress(OSError):  # already reset by the peer
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise LinkClosedError(f"data-plane link to {self.peer} is closed")


class TcpListener(LinkListener):
    """Listens on exactly ``host:port`` for the one peer that presents ``token``.

    Args:
        host: the address to bind (never defaulted: no accidental wildcard).
        port: the port; 0 picks a free one (see ``address``).
        token: the per-link token a connecting peer must present.
        config: local limits of the links it accepts.

    Raises:
        ValueError: malformed token.
        OSError: the address cannot be bound.
    """

    def __init__(
        self, host: str, port: int = 0, *, token: bytes,
        config: DataPlaneConfig = _DEFAULT_CONFIG,
    ) -> None:
        check_token(token)
        if not host:
            raise ValueError("host must be given (listeners never default to a wildcard)")
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._sock = socket.create_server((host, port), family=family, backlog=8)
        self._token = token
        self._config = config
        self._closed = False
        self._host = host

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound; the port is the real one when 0 was asked."""
        return self._host, int(self._sock.getsockname()[1])

    @property
    def spec(self) -> LinkSpec:
        host, port = self.address
        return LinkSpec(kind=TransportKind.TCP, host=host, port=port, token=self._token)

    def accept(self, timeout_s: float) -> TcpTransport:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if self._closed:
                raise LinkClosedError(f"data-plane listener {self.address} is closed")
            if remaining <= 0:
                raise TransportTimeout(
                    f"no authorised data-plane peer on {self.address} within {timeout_s}s",
                    link_closed=False)
            self._sock.settimeout(remaining)
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._closed:
                    raise LinkClosedError(f"data-plane listener {self.address} closed") from e
                raise TransportError(f"accept on {self.address} failed: {e}") from e
            peer = f"{addr[0]}:{addr[1]}"
            refusal = self._handshake(conn, min(remaining, self._config.handshake_timeout_s))
            if refusal is None:
                return TcpTransport(conn, config=self._config, peer=peer)
            logger.warning("data-plane listener %s:%d refused peer %s: %s",
                           *self.address, peer, refusal)
            conn.close()

    def _handshake(self, conn: socket.socket, timeout_s: float) -> str | None:
        """Check the peer's hello and token; answer the verdict. Returns why it was refused."""
        try:
            _tune(conn, self._config)
            conn.settimeout(timeout_s)
            token_len = decode_hello(_recv_small(conn, HELLO.size))
            token = _recv_small(conn, token_len)
            if not hmac.compare_digest(token, self._token):
                _send_quietly(conn, VERDICT_REFUSED)
                return "wrong link token"
            conn.sendall(VERDICT_OK)
            return None
        except ProtocolError as e:
            _send_quietly(conn, VERDICT_REFUSED)
            return str(e)
        except TimeoutError:
            return f"no handshake within {timeout_s:.3g}s"
        except (OSError, LinkClosedError) as e:
            return f"connection lost during handshake: {e}"

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):  # wakes an accept() blocked in another thread
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def _tune(sock: socket.socket, config: DataPlaneConfig) -> None:
    """Latency and liveness options: no Nagle delay on small headers; keepalive on idle links."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if config.tcp_keepalive_idle_s is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", config.tcp_keepalive_idle_s),
                        ("TCP_KEEPINTVL", config.tcp_keepalive_interval_s),
                        ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; other platforms keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _recv_small(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` handshake bytes under the socket's own timeout."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise LinkClosedError(f"EOF after {got} of {n} handshake bytes")
        got += k
    return bytes(buf)


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    """Best-effort verdict to a peer we are about to drop."""
    with contextlib.suppress(OSError):
        sock.sendall(data)
