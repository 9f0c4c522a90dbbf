"""The data-plane contract between neighbouring pipeline stages, and its errors.

Every transport (``tcp``, ``cuda_ipc``, ``nccl``) implements `Transport`, so the
stage loop is written once against this file and never sees sockets, IPC handles or
communicators. Links are created from a `LinkSpec` (see `link.py`), which is what the
control plane's ``Connect`` RPC carries.
"""

from __future__ import annotations

import abc
from array import array
from collections.abc import Sequence
from types import TracebackType

import torch

from stage_worker.dataplane.config import LinkSpec


class TransportError(Exception):
    """Base of every data-plane failure. The stage maps it to "this link is unusable"."""


class LinkClosedError(TransportError):
    """The peer went away (EOF, reset) or this end was closed; the link is dead."""


class LinkRefusedError(TransportError):
    """The peer refused the handshake (wrong link token, or not a stagemesh data-plane peer)."""


class LinkUnreachableError(TransportError):
    """Nothing accepted the connection at the given address (not up yet, or gone)."""


class TransportTimeout(TransportError):  # noqa: N818 (name fixed by the stage contract)
    """A bounded wait (recv, accept, connect) ran out.

    Attributes:
        link_closed: True when the wait ran out mid-message (part of a payload received, or
            part of a message sent), so the byte stream is no longer framed and the transport
            closed itself; False when the link is still usable and the call may be retried.
    """

    def __init__(self, message: str, *, link_closed: bool) -> None:
        super().__init__(message)
        self.link_closed = link_closed


class ProtocolError(TransportError):
    """The peer sent bytes that break the wire format or its limits; the link is closed."""


class StepMismatchError(TransportError):
    """A message arrived for a different step than the one the stage's next plan expects.

    A stage never guesses which plan a message belongs to: this is a hard failure of the
    step, and the router treats the stage as failed for that step.

    Attributes:
        expected_step_id: the step the receiver's plan is for.
        received_step_id: the step the message carried.
    """

    def __init__(self, expected_step_id: int, received_step_id: int) -> None:
        super().__init__(
            f"data-plane step mismatch: expected step {expected_step_id}, "
            f"received step {received_step_id}"
        )
        self.expected_step_id = expected_step_id
        self.received_step_id = received_step_id


LENT_MAX_BYTES = 1 << 20  # the largest message whose tensors `lend_buffers` reuses


class Transport(abc.ABC):
    """One point-to-point, full-duplex link between two pipeline stages.

    Contract (every implementation):

    - **One message per step.** ``send(step_id, tensors)`` delivers the ordered list of tensors
      of one step as one message; ``recv(expected_step_id)`` returns exactly that list, in the
      same order, with the same dtypes, shapes and bit-exact contents.
    - **Ordered.** Messages arrive in the order they were sent; nothing is dropped, merged or
      reordered. Step ids need not be consecutive (micro-batches interleave).
    - **Loud on mismatch.** If the next message carries a step id other than the expected one,
      ``recv`` consumes it and raises `StepMismatchError` naming both ids; it never returns
      tensors of another step.
    - **Blocking, never forever on a dead peer.** ``recv`` blocks until a whole message has
      arrived; a peer that goes away raises `LinkClosedError`; ``timeout_s`` bounds the wait
      with `TransportTimeout`.
    - **Caller keeps its tensors.** ``send`` returns once the tensors may be modified or freed
      by the caller. ``recv`` returns fresh tensors owned by the caller (no aliasing with
      transport buffers), on the transport's device (CPU for ``tcp``).
    - **Concurrency.** One thread may send while another receives (full duplex). Concurrent
      calls in the same direction are serialised. ``close`` may be called from any thread and
      wakes a blocked ``recv`` with `LinkClosedError`.
    - **Never pickle.** Only a fixed binary header and raw tensor bytes cross the link.

    Supported dtypes: float32, float16, bfloat16, int64, int32, bool, uint8.
    """

    @abc.abstractmethod
    def send(
        self, step_id: int, tensors: Sequence[torch.Tensor], timeout_s: float | None = None
    ) -> None:
        """Send the tensors of one step as one message.

        Blocks while the peer is not draining the link (its buffers are full); ``close`` from
        another thread, or ``timeout_s``, ends the wait.

        Args:
            step_id: the step this message belongs to, 0 <= step_id < 2**64.
            tensors: up to 64 tensors of a supported dtype, at most 8 dims each, any strides
                and device (implementations copy what they must).
            timeout_s: upper bound on the whole send; None blocks until it is done.

        Raises:
            ValueError: unsupported dtype, too many tensors or dims, message over the size
                limit, step id out of range (nothing was sent; the link stays usable).
            TransportTimeout: ``timeout_s`` ran out (see its ``link_closed``).
            LinkClosedError: the peer went away or the link was closed.
        """

    def recv(self, expected_step_id: int, timeout_s: float | None = None) -> list[torch.Tensor]:
        """Receive the next message, which must belong to ``expected_step_id``.

        Args:
            expected_step_id: the step of the receiver's next plan.
            timeout_s: upper bound on the whole wait; None waits until the message arrives
                or the peer goes away.

        Returns:
            The message's tensors, in send order.

        Raises:
            StepMismatchError: the message is for another step (it was consumed).
            TransportTimeout: ``timeout_s`` ran out (see its ``link_closed``).
            LinkClosedError: the peer went away or the link was closed.
            ProtocolError: the peer broke the wire format; the link was closed.
        """
        step_id, tensors = self.recv_any(timeout_s)
        if step_id != expected_step_id:
            raise StepMismatchError(expected_step_id, step_id)
        return tensors

    @abc.abstractmethod
    def recv_any(self, timeout_s: float | None = None) -> tuple[int, list[torch.Tensor]]:
        """Receive the next message, whatever its step: for a receiver that does not know
        which step comes next (the first stage's feedback link keeps what arrives by step).

        Returns:
            (the message's step id, its tensors in send order).

        Raises:
            TransportTimeout, LinkClosedError, ProtocolError: as `recv`.
        """

    def send_ints(self, step_id: int, columns: Sequence[Sequence[int]],
                  timeout_s: float | None = None) -> None:
        """Send host integers (the run-ahead feedback's ids) as one message of 1-D int64
        tensors, one per column: the same message as `send` of those tensors, which an
        implementation may build without torch.

        Raises:
            As `send`; OverflowError for a value outside int64.
        """
        # array first: a value outside int64 is an OverflowError, as on `tcp`.
        self.send(step_id, [torch.tensor(array("q", c), dtype=torch.int64) for c in columns],
                  timeout_s)

    def recv_ints(self, timeout_s: float | None = None) -> tuple[int, list[Sequence[int]]]:
        """`recv_any` of a message of 1-D int64 tensors (what `send_ints` sends): its step
        id and each tensor's values.

        Raises:
            ProtocolError: a tensor of another dtype or rank (the link is closed).
            TransportTimeout, LinkClosedError: as `recv`.
        """
        step_id, tensors = self.recv_any(timeout_s)
        for i, t in enumerate(tensors):
            if t.dtype != torch.int64 or t.dim() != 1:
                self.close()
                raise ProtocolError(f"step {step_id}: tensor {i} is {list(t.shape)} "
                                    f"{t.dtype}, expected 1-D int64")
        return step_id, [t.tolist() for t in tensors]

    def readable(self) -> bool:
        """Whether a message has begun to arrive, so a receive now would not wait for one
        to start (no wait here). A transport that cannot tell without receiving says False;
        `tcp`, the feedback link's transport, tells."""
        return False

    def lend_buffers(self, depth: int) -> None:
        """From now on the tensors a receive returns are lent: the `depth`-th message after
        them with the same layout may be written into them. For a receiver done with each
        message's tensors before it receives `depth` more (a stage's activations, consumed
        within their step), which then skips an allocation per message. Byte-stream links
        (`tcp`, `unix`) lend messages up to `LENT_MAX_BYTES`; the others allocate as
        before."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Close the link (idempotent, thread-safe); later calls raise `LinkClosedError`."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether this end has been closed (locally or after a fatal error)."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class LinkListener(abc.ABC):
    """The accepting end of a link: bound and listening, waiting for its one authorised peer.

    The stage that will receive creates the listener, hands ``spec`` (address and token) to the
    router over the control channel, and the router passes it to the upstream stage's
    ``Connect``. A listener may accept again after a link dies (re-link after a restart).
    """

    @property
    @abc.abstractmethod
    def spec(self) -> LinkSpec:
        """What the connecting peer needs: kind, the bound host and port, the link token."""

    @abc.abstractmethod
    def accept(self, timeout_s: float) -> Transport:
        """Wait for a peer that presents the link token and return the link to it.

        Peers that fail the handshake are refused, logged and skipped; waiting continues.

        Args:
            timeout_s: upper bound on the whole wait, refused peers included.

        Raises:
            TransportTimeout: no authorised peer arrived in time.
            LinkClosedError: the listener was closed.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop listening (idempotent). Links already accepted stay open."""

    def __enter__(self) -> LinkListener:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
