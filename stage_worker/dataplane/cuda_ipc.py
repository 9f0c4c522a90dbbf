"""The ``cuda_ipc`` transport: activations between stage processes on one host, GPU to GPU.

The receiving stage (the listener) owns a ring of activation slots in its own device memory,
one plain ``cudaMalloc`` (through CuPy, so the allocation is its own and never shared with
the caching allocator's other blocks). Each slot has two events: *ready*, created and
recorded by the sender after writing the slot, and *free*, created and recorded by the
receiver after copying a message out of it. Memory and event handles are exported with CUDA
IPC (memory through CuPy, events through torch) and travel as raw bytes, never pickled.

A TCP link (`TcpTransport`, with the same link token, keepalive and close semantics) runs
beside the ring and carries everything small::

    listener -> connector   setup   step 0: [meta int64[4] = (version, slots, slot_bytes,
                                    device index), memory handle uint8[64],
                                    free-event handles uint8[slots, 64]]
    connector -> listener   setup   step 0: [ready-event handles uint8[slots, 64]]
    connector -> listener   data    step = the step: [descriptor int64[2 + 11 * count]]
                                    (slot, count, then per tensor: dtype code, ndim, byte
                                    offset in the slot, 8 dims)
    listener -> connector   credit  step = a slot index, no tensors: the slot is free

Per message the sender takes a free slot (blocking on credits: a slow receiver is never
overwritten), makes its stream wait for the slot's *free* event (the receiver's copy out of
the slot's previous message), copies the tensors in, records *ready* and sends the
descriptor. The receiver makes its stream wait for *ready*, copies the tensors out into
fresh tensors, records *free* and returns the slot with a credit. Neither side waits for
the GPU: every wait is on a stream, so a stage queues its next step while the hop's copy
runs. A dead peer, a token refused, a step mismatch: as on TCP (the side link reports them).

Links are one-way (connector sends, listener receives), which is how stages use them: the
upstream stage connects to the downstream stage's listener. Works for two processes on one
GPU and for processes on two GPUs of one host (peer access enabled lazily by the driver).

This module holds the two ends of a linked ring; `cuda_ipc_setup` makes them (the listener,
`connect`), `cuda_ipc_slots` lays messages out in a slot.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from stage_worker.dataplane.cuda_ipc_slots import (
    RingConfig,
    SlotEntry,
    decode_descriptor,
    encode_descriptor,
    layout,
)
from stage_worker.dataplane.tcp import TcpTransport
from stage_worker.dataplane.transport import (
    LinkClosedError,
    ProtocolError,
    Transport,
    TransportError,
    TransportTimeout,
)
from stage_worker.dataplane.wire import MAX_STEP_ID

logger = logging.getLogger(__name__)

RETIRE_AFTER_S = 10.0  # a closed ring is freed this long after (the peer unmapped it)
_NO_SLOT = -1  # the credit queue's "link closed" marker
# Rings whose link closed: (when, device index, pointer), freed RETIRE_AFTER_S later.
_RETIRED: list[tuple[float, int, int]] = []
_RETIRED_LOCK = threading.Lock()


@functools.cache
def unavailable_reason(device: torch.device) -> str | None:
    """Why this process cannot offer ``cuda_ipc`` on ``device`` (None: it can)."""
    if device.type != "cuda":
        return f"the stage runs on {device.type}, not a CUDA device"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cupy is not installed (pip install 'stagemesh[gpu]')"
    return None


# --- the device side --------------------------------------------------------------------


class _Ring:
    """The receiver's slots: one cudaMalloc on its device, exported over IPC."""

    def __init__(self, config: RingConfig) -> None:
        from cupy.cuda import runtime

        self.config = config
        index = _device_index(config.device)
        _Ring.free_retired()
        with _on_device(index):
            self.ptr = int(runtime.malloc(config.total_bytes))
            self.handle = bytes(runtime.ipcGetMemHandle(self.ptr))
        self.buffer = _wrap(self.ptr, config.total_bytes, index)

    def retire(self) -> None:
        """Free the memory later: the peer may still be unmapping it."""
        with _RETIRED_LOCK:
            _RETIRED.append((time.monotonic(), _device_index(self.config.device), self.ptr))

    @staticmethod
    def free_retired(older_than_s: float = RETIRE_AFTER_S) -> None:
        from cupy.cuda import runtime

        now = time.monotonic()
        with _RETIRED_LOCK:
            due = [r for r in _RETIRED if now - r[0] >= older_than_s]
            _RETIRED[:] = [r for r in _RETIRED if now - r[0] < older_than_s]
        for _, index, ptr in due:
            with _on_device(index):
                runtime.free(ptr)


def _slot_views(buffer: torch.Tensor, base: int, entries: Sequence[SlotEntry]
                ) -> list[torch.Tensor]:
    """The entries as tensors over the ring's bytes at slot offset `base`."""
    return [buffer[base + e.offset: base + e.offset + e.nbytes].view(e.dtype).view(e.shape)
            for e in entries]


class CudaIpcReceiver(Transport):
    """The listener's end: receives into its ring. ``send`` is not supported (one-way)."""

    def __init__(self, side: TcpTransport, ring: _Ring,
                 free_events: list[torch.cuda.Event],
                 ready_events: list[torch.cuda.Event]) -> None:
        self._side = side
        self._ring = ring
        self._free = free_events
        self._ready = ready_events
        self._device = ring.config.device
        self.peer = side.peer
        self._close_lock = threading.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed or self._side.closed

    def send(self, step_id: int, tensors: Sequence[torch.Tensor],
             timeout_s: float | None = None) -> None:
        raise TransportError("a cuda_ipc link carries data from the connector to the "
                             "listener only")

    def recv_any(self, timeout_s: float | None = None) -> tuple[int, list[torch.Tensor]]:
        step_id, desc = self._side.recv_any(timeout_s)
        cfg = self._ring.config
        try:
            slot, entries = decode_descriptor(desc, cfg.slots, cfg.slot_bytes)
        except ProtocolError:
            self.close()
            raise
        stream = torch.cuda.current_stream(self._device)
        stream.wait_event(self._ready[slot])
        views = _slot_views(self._ring.buffer, slot * cfg.stride, entries)
        out = [v.clone() for v in views]  # fresh tensors, queued after the sender's write
        self._free[slot].record(stream)
        self._side.send(slot, [])  # the credit: the sender waits for `free` on its stream
        return step_id, out

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._side.close()
        self._ring.retire()


class CudaIpcSender(Transport):
    """The connector's end: writes into the receiver's ring. ``recv`` is not supported."""

    def __init__(self, side: TcpTransport, device: torch.device, peer_ptr: int,
                 ring: RingConfig, free_events: list[torch.cuda.Event],
                 ready_events: list[torch.cuda.Event]) -> None:
        self._side = side
        self._device = device
        self._ptr = peer_ptr
        self._ring = ring
        self._buffer = _wrap(peer_ptr, ring.total_bytes, _device_index(device))
        self._free = free_events
        self._ready = ready_events
        self.peer = side.peer
        self._credits: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(ring.slots):
            self._credits.put(slot)
        self._send_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        self._unmapped = False
        threading.Thread(target=self._read_credits, daemon=True,
                         name="cuda-ipc-credits").start()

    @property
    def closed(self) -> bool:
        return self._closed or self._side.closed

    def send(self, step_id: int, tensors: Sequence[torch.Tensor],
             timeout_s: float | None = None) -> None:
        """Stream-ordered: the copies are queued on the current stream of the sender's
        device, so the caller may free its tensors at once (the caching allocator orders
        reuse after them) and must modify them only on that stream."""
        if not 0 <= step_id <= MAX_STEP_ID:
            raise ValueError(f"step id {step_id} out of range")
        entries = layout(tensors, self._ring.slot_bytes)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._send_lock:
            self._raise_if_closed()
            slot = self._take_slot(step_id, deadline)
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(self._free[slot])
            views = _slot_views(self._buffer, slot * self._ring.stride, entries)
            for view, t in zip(views, tensors, strict=True):
                view.copy_(t, non_blocking=True)
            self._ready[slot].record(stream)
            remaining = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
            self._side.send(step_id, [encode_descriptor(slot, entries)], timeout_s=remaining)

    def recv_any(self, timeout_s: float | None = None) -> tuple[int, list[torch.Tensor]]:
        raise TransportError("a cuda_ipc link carries data from the connector to the "
                             "listener only")

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._side.close()  # wakes a send waiting for a credit (the reader ends)
        # Unmap once no send is writing; a send blocked elsewhere keeps the mapping (the
        # process ends soon, or the receiver's retired ring outlives it).
        if self._send_lock.acquire(timeout=5.0):
            try:
                self._unmap()
            finally:
                self._send_lock.release()

    def _unmap(self) -> None:
        if self._unmapped:
            return
        self._unmapped = True
        from cupy.cuda import runtime

        with contextlib.suppress(Exception), _on_device(_device_index(self._device)):
            torch.cuda.current_stream(self._device).synchronize()  # no write still queued
            runtime.ipcCloseMemHandle(self._ptr)

    def _take_slot(self, step_id: int, deadline: float | None) -> int:
        """A slot the receiver has released; blocks while every slot is in flight."""
        try:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            slot = self._credits.get(timeout=remaining)
        except queue.Empty:
            raise TransportTimeout(f"send of step {step_id} to {self.peer}: no cuda_ipc slot "
                                   "freed in time (the receiver is not reading)",
                                   link_closed=False) from None
        if slot == _NO_SLOT:
            self._credits.put(_NO_SLOT)  # for the next caller too
            raise LinkClosedError(f"cuda_ipc link to {self.peer} is closed")
        return slot

    def _read_credits(self) -> None:
        try:
            while True:
                slot, tensors = self._side.recv_any(None)
                if tensors or not 0 <= slot < self._ring.slots:
                    raise ProtocolError(f"cuda_ipc credit for slot {slot} with "
                                        f"{len(tensors)} tensors")
                self._credits.put(slot)
        except TransportError as e:
            if not self._closed:
                logger.info("cuda_ipc link to %s ended: %s", self.peer, e)
        finally:
            self._side.close()
            self._credits.put(_NO_SLOT)

    def _raise_if_closed(self) -> None:
        if self.closed:
            raise LinkClosedError(f"cuda_ipc link to {self.peer} is closed")


# --- small helpers ------------------------------------------------------------------------


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@contextlib.contextmanager
def _on_device(index: int) -> Any:
    """CuPy's runtime calls act on the calling thread's current device."""
    import cupy

    with cupy.cuda.Device(index):
        yield


def _wrap(ptr: int, nbytes: int, index: int) -> torch.Tensor:
    """uint8[nbytes] over device memory this module manages (no ownership taken)."""
    import cupy

    memory = cupy.cuda.UnownedMemory(ptr, nbytes, None, index)
    array = cupy.ndarray((nbytes,), dtype=cupy.uint8,
                         memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.as_tensor(array, device=torch.device("cuda", index))


__all__ = ["CudaIpcReceiver", "CudaIpcSender", "RingConfig", "unavailable_reason"]
