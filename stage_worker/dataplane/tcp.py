"""The ``tcp`` transport: one TCP stream per link, header + raw bytes (see `wire`), token handshake.

For CPU-only runs, CI, and hops with no GPU path. The stage that receives listens
(`TcpListener`), the stage that sends connects (`TcpTransport.connect`); once linked, the
stream is full duplex. The run-ahead feedback (the last stage's sampled ids, back to stage 0)
is a link of its own, set up the same way (`stage_worker.feedback`).

With `DataPlaneConfig.tls` the stream is TLS (`DataPlaneTls`): the handshake runs before the
token's. An OpenSSL connection must not be read and written from two threads at once, so a
TLS link serialises its two directions (the stage uses each link in one direction only).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import torch

from stage_worker.dataplane.config import (
    DataPlaneConfig,
    LinkSpec,
    TransportKind,
    check_token,
)
from stage_worker.dataplane.handshake import (
    check_token_presented,
    present_token,
    tls_handshake,
    tune_socket,
)
from stage_worker.dataplane.socket_io import DeadlineExpiredError, StreamReader, send_all
from stage_worker.dataplane.transport import (
    LENT_MAX_BYTES,
    LinkClosedError,
    LinkListener,
    LinkUnreachableError,
    Transport,
    TransportError,
    TransportTimeout,
)
from stage_worker.dataplane.wire import (
    MAX_TABLE_BYTES,
    PREFIX,
    TensorHeader,
    byte_view,
    decode_prefix,
    decode_table,
    encode_header,
    encode_int64_header,
    int64_payload,
    tensor_payload,
    wire_tensor,
)

logger = logging.getLogger(__name__)

_DEFAULT_CONFIG = DataPlaneConfig()
# Receive staging: holds the largest header with room to spare, so one recv usually brings a
# whole header (and a whole small message, e.g. a decode step's [B, H] activations for small B).
_STAGING_BYTES = 16 << 10
_TABLES_KEPT = 16  # decoded tensor tables a link keeps (see `TcpTransport._headers`)
_T = TypeVar("_T")
assert PREFIX.size + MAX_TABLE_BYTES <= _STAGING_BYTES


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
        # One OpenSSL connection must not be used by two threads at once.
        self._recv_lock = self._send_lock if isinstance(sock, ssl.SSLSocket) else threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        # One poll object per direction: a poll object must not be polled by two threads.
        self._send_poller = select.poll()
        self._send_poller.register(sock, select.POLLOUT)
        self._reader = StreamReader(sock, _STAGING_BYTES)
        # Tensor tables received lately (as sent) -> their decoded headers: a link's
        # messages repeat a few layouts step after step (each micro-batch's activations, the
        # feedback's two vectors), and a table seen before is not decoded again.
        self._tables: dict[bytes, tuple[TensorHeader, ...]] = {}
        # `lend_buffers`: how many messages' tensors are lent in turn, for `_layout` only.
        self._lend_depth = 0
        self._layout: tuple[TensorHeader, ...] = ()
        self._lent: list[list[tuple[torch.Tensor, memoryview]]] = []

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
            tune_socket(sock, config)
            if config.tls is not None:
                sock = tls_handshake(sock, config.tls.client, deadline, peer, host)
            present_token(sock, token, deadline, peer)
        except BaseException:
            sock.close()
            raise
        return cls(sock, config=config, peer=peer)

    @property
    def closed(self) -> bool:
        return self._closed

    def send(
        self, step_id: int, tensors: Sequence[torch.Tensor], timeout_s: float | None = None
    ) -> None:
        wire = [wire_tensor(t) for t in tensors]
        header = encode_header(step_id, wire, self._config.max_message_bytes)
        self._send_message(step_id, [header, *(byte_view(t) for t in wire)], timeout_s)

    def send_ints(self, step_id: int, columns: Sequence[Sequence[int]],
                  timeout_s: float | None = None) -> None:
        """`Transport.send_ints` without torch: each column packed by `array` (a few
        integers a step: torch's per-call cost would be most of the send)."""
        packed = [array("q", c) for c in columns]
        header = encode_int64_header(step_id, [len(c) for c in packed],
                                     self._config.max_message_bytes)
        self._send_message(step_id, [header, *(memoryview(c).cast("B") for c in packed)],
                           timeout_s)

    def _send_message(self, step_id: int, buffers: list[bytes | memoryview],
                      timeout_s: float | None) -> None:
        """Header + payloads, in one sendmsg (scatter-gather) unless the kernel splits it."""
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

    def recv_any(self, timeout_s: float | None = None) -> tuple[int, list[torch.Tensor]]:
        return self._receive(timeout_s, tensor_payload)

    def recv_ints(self, timeout_s: float | None = None) -> tuple[int, list[Sequence[int]]]:
        """`Transport.recv_ints` without torch: each payload lands in an `array`."""
        step_id, columns = self._receive(timeout_s, int64_payload)
        return step_id, list(columns)

    def _receive(self, timeout_s: float | None,
                 alloc: Callable[[TensorHeader], tuple[_T, memoryview]]) -> tuple[int, list[_T]]:
        """One message (see `_read_message`), under the receive lock; closes the link on
        anything that leaves the stream unframed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._recv_lock:
            self._raise_if_closed()
            try:
                return self._read_message(deadline, timeout_s, alloc)
            except TransportTimeout as e:
                if e.link_closed:
                    self.close()
                raise
            except BaseException:  # protocol error, dead peer, interrupt: stream unframed
                self.close()
                raise

    def _read_message(
        self, deadline: float | None, timeout_s: float | None,
        alloc: Callable[[TensorHeader], tuple[_T, memoryview]],
    ) -> tuple[int, list[_T]]:
        """Read one whole message: prefix, table, then each payload into what `alloc` makes
        of its header (the value returned, and the bytes to fill)."""
        reader = self._reader
        try:
            # Headers are peeked, not consumed: running out of time here keeps the link framed.
            prefix = decode_prefix(reader.peek(PREFIX.size, deadline))
            header_bytes = PREFIX.size + prefix.table_bytes
            table = reader.peek(header_bytes, deadline)[PREFIX.size :]
            headers = self._headers(bytes(table), prefix.num_tensors)
        except DeadlineExpiredError:
            raise TransportTimeout(
                f"no data-plane message from {self.peer} within {timeout_s}s",
                link_closed=False) from None
        reader.consume(header_bytes)
        # Limits are checked: allocate (or take the lent tensors' turn), then receive each
        # payload into its memory.
        made = (cast(list[tuple[_T, memoryview]], self._lent_tensors(headers))
                if alloc is tensor_payload and self._lend_depth else [alloc(h) for h in headers])
        try:
            for _, view in made:
                reader.read_into(view, deadline)
        except DeadlineExpiredError:
            raise TransportTimeout(
                f"data-plane message from {self.peer} incomplete after {timeout_s}s; "
                "link closed", link_closed=True) from None
        return prefix.step_id, [value for value, _ in made]

    def lend_buffers(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        with self._recv_lock:
            self._lend_depth = depth

    def _lent_tensors(self, headers: tuple[TensorHeader, ...]
                      ) -> list[tuple[torch.Tensor, memoryview]]:
        """`lend_buffers`: the tensors of the oldest of the last `depth` messages when this
        message has their layout (a table decoded once is the same tuple each time); new
        ones, kept in turn, otherwise."""
        lent = self._lent
        if headers is not self._layout:  # a new layout: its turn starts (too large: none)
            lent.clear()
            self._layout = headers if sum(h.nbytes for h in headers) <= LENT_MAX_BYTES else ()
        if not self._layout:
            return [tensor_payload(h) for h in headers]
        made = lent.pop(0) if len(lent) == self._lend_depth else [
            tensor_payload(h) for h in headers]
        lent.append(made)
        return made

    def _headers(self, table: bytes, count: int) -> tuple[TensorHeader, ...]:
        """`decode_table` of `table`, or the headers it gave lately for the same bytes and
        count (every field the checks read is in them; this end's limits are fixed). Raises
        ProtocolError as `decode_table`."""
        headers = self._tables.get(table)
        if headers is None or len(headers) != count:
            headers = decode_table(table, count, self._config.max_message_bytes)
            if len(self._tables) >= _TABLES_KEPT:
                self._tables.clear()
            self._tables[table] = headers
        return headers

    def readable(self) -> bool:
        return not self._closed and self._reader.readable()

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
        self._port = int(self._sock.getsockname()[1])
        self._token = token
        self._config = config
        self._closed = False
        self._host = host

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound; the port is the real one when 0 was asked."""
        return self._host, self._port

    @property
    def spec(self) -> LinkSpec:
        host, port = self.address
        return LinkSpec(kind=TransportKind.TCP, host=host, port=port, token=self._token)

    def accept(self, timeout_s: float) -> TcpTransport:
        where = f"{self._host}:{self._port}"
        return accept_linked(self._sock, where, self._token, self._config, timeout_s,
                             lambda: self._closed, self._config.tls is not None)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):  # wakes an accept() blocked in another thread
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def accept_linked(sock: socket.socket, where: str, token: bytes, config: DataPlaneConfig,
                  timeout_s: float, closed: Callable[[], bool], tls: bool) -> TcpTransport:
    """A listener's accept (`LinkListener.accept`) on the listening stream socket `sock`
    (TCP or Unix-domain; `where` names it in errors): the first peer that passes the TLS
    handshake (`tls`, TCP only) and presents `token` becomes the link; others are refused,
    logged and skipped. `closed()` says whether the listener was closed meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if closed():
            raise LinkClosedError(f"data-plane listener {where} is closed")
        if remaining <= 0:
            raise TransportTimeout(
                f"no authorised data-plane peer on {where} within {timeout_s}s",
                link_closed=False)
        sock.settimeout(remaining)
        try:
            conn, addr = sock.accept()
        except TimeoutError:
            continue
        except OSError as e:
            if closed():
                raise LinkClosedError(f"data-plane listener {where} closed") from e
            raise TransportError(f"accept on {where} failed: {e}") from e
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else f"a peer of {where}"
        with contextlib.suppress(OSError):  # a peer already gone fails the handshake below
            tune_socket(conn, config)
        wait = min(remaining, config.handshake_timeout_s)
        refusal = None
        if tls:
            assert config.tls is not None
            try:
                conn = tls_handshake(conn, config.tls.server, time.monotonic() + wait, peer)
            except TransportError as e:
                refusal = str(e)
        if refusal is None:
            refusal = check_token_presented(conn, token, wait)
        if refusal is None:
            return TcpTransport(conn, config=config, peer=peer)
        logger.warning("data-plane listener %s refused peer %s: %s", where, peer, refusal)
        conn.close()
