"""The ``nccl`` transport: activations between stages on different hosts, GPU to GPU.

Each link is a 2-rank NCCL communicator of its own (the listener is rank 0 and receives, the
connector is rank 1 and sends), made from a unique id that the listener draws and sends over
the side link (`side_link`: plain TCP, with the link token, keepalive and close semantics).
The side link carries everything small, as raw bytes, never pickled::

    listener -> connector   setup   step 0: [meta int64[4] = (version, credits, device index,
                                    id bytes), unique id uint8[id bytes]]
    connector -> listener   join    step 0, no tensors: the connector joins the communicator
    connector -> listener   data    step = the step: [descriptor int64[1 + 10 * count]]
                                    (count, then per tensor: dtype code, ndim, 8 dims)
    listener -> connector   credit  step 0, no tensors: one more message may be sent

and NCCL carries each message's tensors, as bytes, in order, on a CUDA stream of the link's.

**Send.** The sender takes a credit (at most ``credits`` messages are in flight: sent and
not yet taken up by the receiver; a sender without one blocks, ``timeout_s`` bounds it),
writes the descriptor, makes the link's stream wait for the caller's current stream (an
event: the tensors are written), queues one NCCL send per tensor on the link's stream and
makes the caller's current stream wait for the link's stream. It returns without waiting
for the GPU: the caller may free its tensors at once (the caching allocator reuses them on
its stream, after the sends) and must modify them only on that stream, as on ``cuda_ipc``.

**Receive.** The receiver reads a descriptor, allocates fresh tensors on its device, queues
one NCCL receive per tensor on the link's stream (after the caller's stream, whose memory
the allocator handed out), makes the caller's stream wait for it and returns a credit. A
message of another step is still received whole, so both NCCL streams stay in step and the
next message arrives; then `StepMismatchError` names both ids (`Transport.recv`).

**Close.** Closing either end closes the side link and aborts the communicator
(``ncclCommAbort``), which ends the NCCL operations still queued on the GPU; the peer sees
the side link end (`LinkClosedError`) and aborts its own. A dead peer is seen the same way,
on the side link (EOF, reset, keepalive), never by waiting on the GPU.

The NCCL calls sit behind `NcclBackend` / `NcclComm` (make a communicator from a unique id,
send and receive a byte tensor on the link's stream, order the streams, abort), so the
framing, set-up and flow control run on CPU against a stand-in for NCCL; `nccl_backend`
holds them and the real one (cupy's NCCL bindings). `nccl_setup` makes the two ends (the
listener, `connect`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

import torch

from stage_worker.dataplane.config import TransportKind
from stage_worker.dataplane.nccl_backend import NcclComm
from stage_worker.dataplane.side_link import CreditedSender, SideLinkEnd, time_left
from stage_worker.dataplane.tcp import TcpTransport
from stage_worker.dataplane.transport import (
    LinkClosedError,
    ProtocolError,
    TransportError,
    TransportTimeout,
)
from stage_worker.dataplane.wire import DTYPE_CODES, MAX_NDIM, MAX_STEP_ID, MAX_TENSORS

ENTRY_WIDTH = 2 + MAX_NDIM  # dtype code, ndim, dims
DEFAULT_CREDITS = 4  # messages in flight per link
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


# --- the descriptor ------------------------------------------------------------------------


def encode_descriptor(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64[1 + 10 * count]: count, then each tensor's dtype code, ndim and 8 dims.

    Raises:
        ValueError: too many tensors, a dtype the data plane does not carry, too many dims.
    """
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"{len(tensors)} tensors in one message, the data plane allows "
                         f"{MAX_TENSORS}")
    values = [len(tensors)]
    for t in tensors:
        if t.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {t.dtype} cannot travel on the data plane")
        if t.dim() > MAX_NDIM:
            raise ValueError(f"tensor has {t.dim()} dims, the data plane allows {MAX_NDIM}")
        values += [DTYPE_CODES[t.dtype], t.dim(), *t.shape, *[0] * (MAX_NDIM - t.dim())]
    return torch.tensor(values, dtype=torch.int64)


def decode_descriptor(desc: Sequence[torch.Tensor], max_message_bytes: int
                      ) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """Each tensor's (dtype, shape), every field checked, the total against the limit.

    Raises:
        ProtocolError: not a descriptor, or one over ``max_message_bytes``.
    """
    if len(desc) != 1 or desc[0].dtype != torch.int64 or desc[0].dim() != 1:
        raise ProtocolError("nccl data message is not one int64 descriptor")
    values = desc[0].tolist()
    count = values[0] if values else -1
    if not 0 <= count <= MAX_TENSORS or len(values) != 1 + ENTRY_WIDTH * count:
        raise ProtocolError(f"nccl descriptor of {len(values)} values is malformed")
    entries, total = [], 0
    for i in range(count):
        code, ndim, *dims = values[1 + i * ENTRY_WIDTH: 1 + (i + 1) * ENTRY_WIDTH]
        dtype = _CODE_DTYPES.get(code)
        if dtype is None or not 0 <= ndim <= MAX_NDIM or any(d < 0 for d in dims):
            raise ProtocolError(f"nccl descriptor entry {i}: dtype code {code}, ndim {ndim}, "
                                f"dims {dims}")
        shape = tuple(dims[:ndim])
        total += math.prod(shape) * dtype.itemsize
        if total > max_message_bytes:
            raise ProtocolError(f"nccl message of over {total} bytes, the limit is "
                                f"{max_message_bytes}")
        entries.append((dtype, shape))
    return entries


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """uint8[nbytes] over a contiguous tensor's memory (NCCL moves bytes)."""
    return tensor.reshape(-1).view(torch.uint8)


# --- the two ends ------------------------------------------------------------------------


class _NcclEnd(SideLinkEnd):
    """What both ends share: the communicator is aborted before a closed link is reported,
    so whoever sees `LinkClosedError` may count on the queued NCCL operations ending."""

    _comm: NcclComm

    def _raise_if_closed(self) -> None:
        if self.closed:
            self.close()  # the peer may have ended the side link: abort our end first
            raise self._closed_error()

    def _release(self) -> None:
        self._comm.abort()  # the peer sees the side link's EOF and aborts its end


class NcclReceiver(_NcclEnd):
    """The listener's end (rank 0): receives. ``send`` is not supported (one-way)."""

    kind = TransportKind.NCCL
    _ARTICLE = "an"

    def __init__(self, side: TcpTransport, comm: NcclComm, device: torch.device,
                 max_message_bytes: int) -> None:
        super().__init__(side)
        self._comm = comm
        self._device = device
        self._max_bytes = max_message_bytes
        self._recv_lock = threading.Lock()

    def recv_any(self, timeout_s: float | None = None) -> tuple[int, list[torch.Tensor]]:
        with self._recv_lock:
            self._raise_if_closed()
            try:
                step_id, desc = self._side.recv_any(timeout_s)
                entries = decode_descriptor(desc, self._max_bytes)
            except TransportTimeout as e:
                if e.link_closed:
                    self.close()
                raise
            except TransportError:
                self.close()  # a dead or confused peer: end the communicator too
                raise
            out = [torch.empty(shape, dtype=dtype, device=self._device)
                   for dtype, shape in entries]
            try:
                self._comm.order_after_caller()  # the allocator's memory is free
                for t in out:
                    if t.numel():
                        self._comm.recv(_as_bytes(t), peer=1)
                self._comm.order_caller_after()
                self._side.send(0, [])  # the credit
            except TransportError:
                self.close()
                raise
            except Exception as e:  # NCCL failed (aborted, peer gone)
                self.close()
                raise LinkClosedError(f"nccl receive from {self.peer} failed: {e}") from e
            return step_id, out


class NcclSender(CreditedSender, _NcclEnd):
    """The connector's end (rank 1): sends. ``recv`` is not supported. Its credits are all
    0: any ``credits`` messages may be in flight."""

    kind = TransportKind.NCCL
    _ARTICLE = "an"
    _CREDIT_UNIT = "step"
    _STARVED = "every nccl credit is in flight"

    def __init__(self, side: TcpTransport, comm: NcclComm, device: torch.device,
                 credits: int) -> None:
        super().__init__(side, [0] * credits)
        self._comm = comm
        self._device = device
        self._start_credit_reader()

    def send(self, step_id: int, tensors: Sequence[torch.Tensor],
             timeout_s: float | None = None) -> None:
        """Stream-ordered (see the module): returns once the sends are queued after the
        caller's stream and the caller's stream waits for them."""
        if not 0 <= step_id <= MAX_STEP_ID:
            raise ValueError(f"step id {step_id} out of range")
        desc = encode_descriptor(tensors)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._send_lock:
            self._raise_if_closed()
            credit = self._take_credit(step_id, deadline)
            # Copies (another device, strided) are made on the caller's stream; they stay
            # referenced until the caller's stream waits for the sends.
            payload = [t.to(self._device).contiguous() for t in tensors]
            remaining = None if deadline is None else time_left(deadline)
            try:
                self._side.send(step_id, [desc], timeout_s=remaining)
            except TransportTimeout as e:
                if e.link_closed:
                    self.close()
                else:
                    self._credits.put(credit)  # nothing went out: the credit is still ours
                raise
            except TransportError:
                self.close()  # the side link is gone: the communicator goes with it
                raise
            try:
                self._comm.order_after_caller()
                for t in payload:
                    if t.numel():
                        self._comm.send(_as_bytes(t), peer=0)
                self._comm.order_caller_after()
            except Exception as e:  # NCCL failed (aborted, peer gone)
                self.close()
                raise LinkClosedError(f"nccl send to {self.peer} failed: {e}") from e

    def _credits_ended(self) -> None:
        self.close()  # the peer is gone: end the communicator (queued sends end)


__all__ = ["NcclReceiver", "NcclSender", "decode_descriptor", "encode_descriptor"]
