"""The token handshake of a stream data-plane link (TCP or Unix-domain), TLS on a TCP one, and
the socket options every TCP link gets.

Wire format (see `wire`): the connector sends the hello struct and its token; the listener
answers ``SMOK`` or ``SMNO``. Both sides run this on a socket with a timeout (``settimeout``),
before the link's blocking life begins.
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import ssl
import time

from stage_worker.dataplane.config import DataPlaneConfig
from stage_worker.dataplane.transport import (
    LinkClosedError,
    LinkRefusedError,
    ProtocolError,
    TransportTimeout,
)
from stage_worker.dataplane.wire import (
    HELLO,
    VERDICT_BYTES,
    VERDICT_OK,
    VERDICT_REFUSED,
    decode_hello,
    encode_hello,
)


def present_token(sock: socket.socket, token: bytes, deadline: float, peer: str) -> None:
    """Connector side: send the hello and token, wait for the listener's verdict.

    Raises:
        LinkRefusedError: the listener said no, or hung up during the handshake.
        TransportTimeout: no verdict before ``deadline`` (a ``time.monotonic()`` value).
    """
    try:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        sock.sendall(encode_hello(token))
        verdict = _recv_small(sock, VERDICT_BYTES)
    except TimeoutError as e:
        raise TransportTimeout(f"handshake with {peer} timed out", link_closed=True) from e
    except (OSError, LinkClosedError) as e:
        raise LinkRefusedError(f"data-plane peer {peer} closed the handshake: {e}") from e
    if verdict != VERDICT_OK:
        raise LinkRefusedError(f"data-plane peer {peer} refused the link token")


def check_token_presented(conn: socket.socket, token: bytes, timeout_s: float) -> str | None:
    """Listener side: read the peer's hello and token, compare in constant time, answer.

    Args:
        conn: a freshly accepted connection.
        token: the link's token.
        timeout_s: how long the peer may take to present it.

    Returns:
        None when the peer is accepted (it was told ``SMOK``), else why it was refused (it was
        told ``SMNO`` where still possible; the caller closes the connection).
    """
    try:
        conn.settimeout(timeout_s)
        presented = _recv_small(conn, decode_hello(_recv_small(conn, HELLO.size)))
        if not hmac.compare_digest(presented, token):
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


UNIX_SEND_BUFFER_BYTES = 4 << 20  # as TCP's default largest send buffer (tcp_wmem)


def tune_socket(sock: socket.socket, config: DataPlaneConfig) -> None:
    """Latency and liveness options of a TCP link: no Nagle delay on small headers; keepalive
    on idle links. A Unix-domain link has neither; its send buffer, fixed where TCP's grows
    to a few MiB, is asked for as much (the kernel caps it at `net.core.wmem_max`), so a
    stage hands off a large prefill's activations without waiting for its peer to read, as
    over TCP."""
    if sock.family == getattr(socket, "AF_UNIX", None):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SEND_BUFFER_BYTES)
        return
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


def tls_handshake(sock: socket.socket, context: ssl.SSLContext, deadline: float, peer: str,
                  server_hostname: str | None = None) -> ssl.SSLSocket:
    """`sock` wrapped in TLS, the handshake done before `deadline` (a server when
    `server_hostname` is None; a client checks the peer's certificate names it). On failure
    the connection is closed.

    Raises:
        LinkRefusedError: the handshake failed (no TLS on the other end, a certificate the
            CA did not sign or that does not name the host dialled).
        TransportTimeout: the handshake did not finish in time.
    """
    wrapped = context.wrap_socket(sock, server_side=server_hostname is None,
                                  server_hostname=server_hostname,
                                  do_handshake_on_connect=False)
    try:
        wrapped.settimeout(max(deadline - time.monotonic(), 1e-3))
        wrapped.do_handshake()
    except TimeoutError as e:
        wrapped.close()
        raise TransportTimeout(f"TLS handshake with data-plane peer {peer} timed out",
                               link_closed=True) from e
    except (ssl.SSLError, OSError) as e:
        wrapped.close()
        raise LinkRefusedError(f"TLS handshake with data-plane peer {peer} failed ({e}); "
                               "every stage of the pipeline must run its data plane over TLS "
                               "(--dataplane-tls-ca), with a certificate naming the address "
                               "it is dialled at") from e
    return wrapped
