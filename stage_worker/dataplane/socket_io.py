"""Whole-buffer socket I/O without copies: scatter-gather sends, receives into caller memory.

The socket stays in blocking mode for its whole life: a receive with a deadline waits with
``poll`` first instead of ``settimeout``, so a bounded ``recv`` on one thread never changes the
behaviour of a ``send`` running on another.
"""

from __future__ import annotations

import math
import select
import socket
import time
from collections import deque
from collections.abc import Sequence

from stage_worker.dataplane.transport import LinkClosedError

# Linux IOV_MAX is 1024; a message has at most 1 header + 64 payloads, so this never splits
# one message across more sendmsg calls than the kernel's partial writes already require.
_MAX_IOV = 1024


class DeadlineExpiredError(Exception):
    """A deadline ran out after ``transferred`` bytes of the buffers had been sent/received."""

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
        buffers: byte buffers, sent back to back; empty ones are skipped.
        deadline: ``time.monotonic()`` value after which to give up, or None to block until
            everything is queued. With a deadline each ``sendmsg`` is non-blocking
            (``MSG_DONTWAIT``) and the wait for buffer space is a ``poll``.
        poller: a poll object with ``sock`` registered for POLLOUT; needed with ``deadline``.

    Raises:
        DeadlineExpiredError: the deadline ran out (``transferred`` counts the bytes sent).
        LinkClosedError: the peer reset the connection or the socket was closed.
    """
    pending = deque(memoryview(b).cast("B") for b in buffers if len(b))
    flags = 0 if deadline is None else socket.MSG_DONTWAIT
    done = 0
    try:
        while pending:
            if deadline is not None:
                assert poller is not None, "a deadline needs a poller"
                _wait(poller, deadline, done)
            try:
                sent = sock.sendmsg(list(pending)[:_MAX_IOV], [], flags)
            except BlockingIOError:
                continue
            done += sent
            # Drop what went out; a partial write leaves a tail of the first unsent buffer.
            while sent:
                head = pending[0]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    pending.popleft()
                else:
                    pending[0] = head[sent:]
                    sent = 0
    except OSError as e:  # EPIPE, ECONNRESET, EBADF after a concurrent close
        raise LinkClosedError(f"data-plane peer went away while sending: {e}") from e


def _wait(poller: select.poll, deadline: float, done: int) -> None:
    """Wait until the poller's socket is ready, or raise DeadlineExpiredError(done)."""
    remaining_ms = (deadline - time.monotonic()) * 1000.0
    if remaining_ms <= 0 or not poller.poll(max(1, math.ceil(remaining_ms))):
        raise DeadlineExpiredError(done)


def recv_exact(
    sock: socket.socket, view: memoryview, deadline: float | None, poller: select.poll | None
) -> None:
    """Fill ``view`` completely from ``sock``.

    Args:
        sock: a blocking stream socket.
        view: a writable, flat byte view; empty views return at once.
        deadline: ``time.monotonic()`` value after which to give up, or None to wait forever.
        poller: a poll object with ``sock`` registered for POLLIN; needed when ``deadline``
            is set.

    Raises:
        DeadlineExpiredError: the deadline ran out (``transferred`` says how much had arrived).
        LinkClosedError: EOF or a reset from the peer, or the socket was closed locally.
    """
    total = view.nbytes
    received = 0
    try:
        while received < total:
            if deadline is not None:
                assert poller is not None, "a deadline needs a poller"
                _wait(poller, deadline, received)
            n = sock.recv_into(view[received:])
            if n == 0:
                raise LinkClosedError(
                    f"data-plane peer closed the link ({received} of {total} bytes received)"
                )
            received += n
    except OSError as e:  # ECONNRESET, EBADF after a concurrent close
        raise LinkClosedError(f"data-plane link failed while receiving: {e}") from e
