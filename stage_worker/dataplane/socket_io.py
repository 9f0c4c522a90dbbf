"""Whole-buffer socket I/O with few copies and few syscalls.

Sends are scatter-gather (``sendmsg`` of header + payloads). Receives go through a small
staging buffer for headers, which one ``recv`` fills with as much as has arrived: a whole header,
often a whole small message. Payload bytes that arrived with the header are copied out of it;
the rest of a payload is received straight into the tensor's memory.

The socket stays in blocking mode for its whole life: a receive with a deadline waits with
``poll`` first instead of ``settimeout``, so a bounded ``recv`` on one thread never changes the
behaviour of a ``send`` running on another.
"""

from __future__ import annotations

import math
import select
import socket
import ssl
import time
from collections.abc import Sequence

from stage_worker.dataplane.transport import LinkClosedError

# Linux IOV_MAX is 1024; a message has at most 1 header + 64 payloads, so this never splits
# one message across more sendmsg calls than the kernel's partial writes already require.
_MAX_IOV = 1024


class DeadlineExpiredError(Exception):
    """A deadline ran out; for sends, ``transferred`` bytes had gone out."""

    def __init__(self, transferred: int) -> None:
        super().__init__(f"deadline expired after {transferred} bytes")
        self.transferred = transferred


def send_all(
    sock: socket.socket,
    buffers: Sequence[bytes | memoryview],
    deadline: float | None,
    poller: select.poll | None,
) -> None:
    """Write every buffer, in order, with as few ``sendmsg`` calls as the kernel allows.

    Args:
        sock: a blocking stream socket.
        buffers: flat byte buffers, sent back to back; empty ones are skipped.
        deadline: ``time.monotonic()`` value after which to give up, or None to block until
            everything is queued. With a deadline each ``sendmsg`` is non-blocking
            (``MSG_DONTWAIT``), and only one that finds no buffer space waits, in a ``poll``.
        poller: a poll object with ``sock`` registered for POLLOUT; needed with ``deadline``.

    Raises:
        DeadlineExpiredError: the deadline ran out (``transferred`` counts the bytes sent).
        LinkClosedError: the peer reset the connection or the socket was closed.
    """
    pending = list(filter(len, buffers))
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg, no flags: one record stream
        _send_all_tls(sock, pending, deadline, poller)
        return
    total = sum(map(len, pending))
    flags = 0 if deadline is None else socket.MSG_DONTWAIT
    done = 0
    try:
        while done < total:
            try:  # with a deadline, non-blocking: most sends find room, and skip the poll
                sent = sock.sendmsg(pending[:_MAX_IOV], [], flags)
            except BlockingIOError:
                assert poller is not None and deadline is not None, "a deadline needs a poller"
                _wait(poller, deadline, done)
                continue
            done += sent
            if done < total:  # partial write: drop what went out, keep the tail
                pending = _drop_front(pending, sent)
    except OSError as e:  # EPIPE, ECONNRESET, EBADF after a concurrent close
        raise LinkClosedError(f"data-plane peer went away while sending: {e}") from e


def _send_all_tls(sock: ssl.SSLSocket, buffers: Sequence[bytes | memoryview],
                  deadline: float | None, poller: select.poll | None) -> None:
    """`send_all` over TLS: each buffer with ``sendall``; with a deadline the wait for room
    is a ``poll`` before each buffer (a peer that stops reading mid-buffer holds the
    write until it reads again or the link is closed)."""
    done = 0
    try:
        for buf in buffers:
            if deadline is not None:
                assert poller is not None, "a deadline needs a poller"
                _wait(poller, deadline, done)
            sock.sendall(buf)
            done += len(buf)
    except OSError as e:  # includes ssl.SSLError
        raise LinkClosedError(f"data-plane peer went away while sending: {e}") from e


def _drop_front(buffers: list[bytes | memoryview], n: int) -> list[bytes | memoryview]:
    """``buffers`` without their first ``n`` bytes (whole buffers dropped, one sliced)."""
    i = 0
    while n >= len(buffers[i]):
        n -= len(buffers[i])
        i += 1
    rest = buffers[i:]
    rest[0] = memoryview(rest[0])[n:]
    return rest


def _wait(poller: select.poll, deadline: float, done: int) -> None:
    """Wait until the poller's socket is ready, or raise DeadlineExpiredError(done)."""
    remaining_ms = (deadline - time.monotonic()) * 1000.0
    if remaining_ms <= 0 or not poller.poll(max(1, math.ceil(remaining_ms))):
        raise DeadlineExpiredError(done)


class StreamReader:
    """Exact-size reads from a blocking stream socket, through a small staging buffer.

    Header bytes are looked at with `peek` and only then `consume`d, so a wait that runs out
    while a header is incomplete leaves the stream framed (the partial header stays buffered).
    Only the caller of `read_into` can leave a message half-read.

    Args:
        sock: a blocking stream socket, read by nobody else.
        staging_bytes: staging capacity; must hold the largest header.
    """

    def __init__(self, sock: socket.socket, staging_bytes: int) -> None:
        self._sock = sock
        self._poller = select.poll()  # polled only by the (single) receiving thread
        self._poller.register(sock, select.POLLIN)
        self._staging = memoryview(bytearray(staging_bytes))
        self._start = 0  # buffered bytes are _staging[_start:_end]
        self._end = 0

    def peek(self, n: int, deadline: float | None) -> memoryview:
        """The next ``n`` bytes of the stream, buffered but not consumed.

        Raises:
            DeadlineExpiredError: fewer than ``n`` bytes arrived in time (nothing is lost).
            LinkClosedError: EOF or a reset from the peer, or the socket was closed locally.
        """
        assert n <= len(self._staging), "peek beyond the staging capacity"
        if self._end - self._start < n:
            if self._start + n > len(self._staging):  # compact: move the tail to the front
                size = self._end - self._start
                self._staging[:size] = self._staging[self._start : self._end]
                self._start, self._end = 0, size
            while self._end - self._start < n:
                # Read whatever has arrived, up to the staging capacity (may include payload).
                self._end += self._recv_some(self._staging[self._end :], deadline)
        return self._staging[self._start : self._start + n]

    def readable(self) -> bool:
        """Whether bytes are buffered or the socket has some (or EOF) to read, without a
        wait (the receiving thread only, as every read)."""
        if self._end > self._start:
            return True
        sock = self._sock
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return True
        return bool(self._poller.poll(0))

    def consume(self, n: int) -> None:
        """Drop ``n`` bytes that `peek` returned."""
        assert n <= self._end - self._start, "consume past the buffered bytes"
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0

    def read_into(self, view: memoryview, deadline: float | None) -> None:
        """Fill ``view`` (flat, writable bytes): buffered bytes first, then from the socket.

        Raises:
            DeadlineExpiredError: the deadline ran out; ``view`` is partly filled.
            LinkClosedError: EOF or a reset from the peer, or the socket was closed locally.
        """
        take = min(self._end - self._start, len(view))
        if take:
            view[:take] = self._staging[self._start : self._start + take]
            self.consume(take)
        got = take
        while got < len(view):  # the rest of a payload has mostly arrived: try without a wait
            got += self._recv_some(view[got:], deadline, try_first=True)

    def _recv_some(self, view: memoryview, deadline: float | None,
                   try_first: bool = False) -> int:
        """One ``recv_into`` (after a bounded wait when there is a deadline); returns n > 0.
        `try_first`: a non-blocking ``recv_into`` first, and the wait only if it found
        nothing (a plain socket: one syscall where bytes are there already)."""
        sock = self._sock
        plain = not isinstance(sock, ssl.SSLSocket)
        if try_first and deadline is not None and plain:
            try:
                n = sock.recv_into(view, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
            except OSError as e:
                raise LinkClosedError(f"data-plane link failed while receiving: {e}") from e
            else:
                if n == 0:
                    raise LinkClosedError("data-plane peer closed the link")
                return n
        # TLS may hold decrypted bytes already: the socket would not poll readable for them.
        if deadline is not None and not (isinstance(sock, ssl.SSLSocket) and sock.pending()):
            _wait(self._poller, deadline, 0)
        try:
            n = sock.recv_into(view)
        except OSError as e:  # ECONNRESET, EBADF after a concurrent close
            raise LinkClosedError(f"data-plane link failed while receiving: {e}") from e
        if n == 0:
            raise LinkClosedError("data-plane peer closed the link")
        return n
