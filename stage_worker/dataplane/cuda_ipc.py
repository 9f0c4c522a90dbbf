"""The ``cuda_ipc`` transport: activations between stage processes on one host, GPU to GPU.

The receiving stage (the listener) owns a ring of activation slots in its own device memory,
one plain ``cudaMalloc`` (through CuPy, so the allocation is its own and never shared with
the caching allocator's other blocks). Each slot has two events: *ready*, created and
recorded by the sender after writing the slot, and *free*, created and recorded by the
receiver after copying a message out of it. Memory and event handles are exported with CUDA
IPC (memory through CuPy, events through torch) and travel as raw bytes, never pickled.

The side link (`side_link`: TCP, with the link token) runs beside the ring and carries
everything small::

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
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from stage_worker.dataplane.config import TransportKind
from stage_worker.dataplane.cuda_ipc_slots import (
    RingConfig,
    SlotEntry,
    decode_descriptor,
    encode_descriptor,
    layout,
)
from stage_worker.dataplane.side_link import (
    CreditedSender,
    SideLinkEnd,
    time_left,
    unavailable_reason,
)
from stage_worker.dataplane.tcp import TcpTransport
from stage_worker.dataplane.transport import ProtocolError
from stage_worker.dataplane.wire import MAX_STEP_ID

RETIRE_AFTER_S = 10.0  # a closed ring is freed this long after (the peer unmapped it)
# Rings whose link closed: (when, device index, pointer), freed RETIRE_AFTER_S later.
_RETIRED: list[tuple[float, int, int]] = []
_RETIRED_LOCK = threading.Lock()


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


class CudaIpcReceiver(SideLinkEnd):
    """The listener's end: receives into its ring. ``send`` is not supported (one-way)."""

    kind = TransportKind.CUDA_IPC

    def __init__(self, side: TcpTransport, ring: _Ring,
                 free_events: list[torch.cuda.Event],
                 ready_events: list[torch.cuda.Event]) -> None:
        super().__init__(side)
        self._ring = ring
        self._free = free_events
        self._ready = ready_events
        self._device = ring.config.device

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

    def _release(self) -> None:
        self._ring.retire()


class CudaIpcSender(CreditedSender):
    """The connector's end: writes into the receiver's ring. ``recv`` is not supported.
    Its credits are the ring's slot indices: a slot is written only once the receiver
    returned it (a slow receiver is never overwritten)."""

    kind = TransportKind.CUDA_IPC
    _CREDIT_UNIT = "slot"
    _STARVED = "no cuda_ipc slot freed in time"

    def __init__(self, side: TcpTransport, device: torch.device, peer_ptr: int,
                 ring: RingConfig, free_events: list[torch.cuda.Event],
                 ready_events: list[torch.cuda.Event]) -> None:
        super().__init__(side, range(ring.slots))
        self._device = device
        self._ptr = peer_ptr
        self._ring = ring
        self._buffer = _wrap(peer_ptr, ring.total_bytes, _device_index(device))
        self._free = free_events
        self._ready = ready_events
        self._unmapped = False
        self._start_credit_reader()

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
            slot = self._take_credit(step_id, deadline)
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(self._free[slot])
            views = _slot_views(self._buffer, slot * self._ring.stride, entries)
            for view, t in zip(views, tensors, strict=True):
                view.copy_(t, non_blocking=True)
            self._ready[slot].record(stream)
            remaining = None if deadline is None else time_left(deadline)
            self._side.send(step_id, [encode_descriptor(slot, entries)], timeout_s=remaining)

    def _release(self) -> None:
        # The side link is closed (a send waiting for a credit wakes: the reader ends).
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
