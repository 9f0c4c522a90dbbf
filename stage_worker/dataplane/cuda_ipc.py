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
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from stage_worker.dataplane.config import DataPlaneConfig, LinkSpec, TransportKind
from stage_worker.dataplane.tcp import TcpListener, TcpTransport
from stage_worker.dataplane.transport import (
    LinkClosedError,
    LinkListener,
    LinkRefusedError,
    ProtocolError,
    StepMismatchError,
    Transport,
    TransportError,
    TransportTimeout,
)
from stage_worker.dataplane.wire import DTYPE_CODES, MAX_NDIM, MAX_STEP_ID, MAX_TENSORS

logger = logging.getLogger(__name__)

SETUP_VERSION = 1
IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t
TENSOR_ALIGN = 256  # byte offset of every tensor in a slot
RING_ALIGN = 2 << 20  # CUDA's advice: share only 2 MiB-aligned allocations over IPC
ENTRY_WIDTH = 3 + MAX_NDIM  # dtype code, ndim, offset, dims
RETIRE_AFTER_S = 10.0  # a closed ring is freed this long after (the peer unmapped it)
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_NO_SLOT = -1  # the credit queue's "link closed" marker
_CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_DEFAULT_CONFIG = DataPlaneConfig()
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


@dataclass(frozen=True)
class RingConfig:
    """The receiver's ring: ``slots`` slots of ``slot_bytes`` each on ``device``.

    slot_bytes: the largest message the link carries (tensors laid out at 256-byte offsets);
        a stage sizes it from its largest step: max tokens x hidden size x element size.
    slots: messages in flight (sent, not yet copied out by the receiver).
    """

    device: torch.device
    slot_bytes: int
    slots: int = 4

    def __post_init__(self) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"a cuda_ipc ring lives on a CUDA device, not {self.device}")
        if self.slot_bytes <= 0 or self.slots <= 0:
            raise ValueError(f"slot_bytes and slots must be > 0, got {self.slot_bytes}, "
                             f"{self.slots}")

    @property
    def stride(self) -> int:
        """Bytes from one slot's start to the next (slots start 256-byte aligned)."""
        return _align(self.slot_bytes, TENSOR_ALIGN)

    @property
    def total_bytes(self) -> int:
        return _align(self.stride * self.slots, RING_ALIGN)


# --- the descriptor (pure: tested on CPU) ------------------------------------------------


@dataclass(frozen=True)
class SlotEntry:
    """Where one tensor of a message lies in its slot."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def layout(tensors: Sequence[torch.Tensor], slot_bytes: int) -> list[SlotEntry]:
    """Each tensor's place in a slot, 256-byte aligned, in order.

    Raises:
        ValueError: too many tensors, a dtype the data plane does not carry, too many dims,
            or a message larger than a slot (nothing was sent; the link stays usable).
    """
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"{len(tensors)} tensors in one message, the data plane allows "
                         f"{MAX_TENSORS}")
    entries, offset = [], 0
    for t in tensors:
        if t.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {t.dtype} cannot travel on the data plane")
        if t.dim() > MAX_NDIM:
            raise ValueError(f"tensor has {t.dim()} dims, the data plane allows {MAX_NDIM}")
        entry = SlotEntry(t.dtype, tuple(t.shape), offset)
        entries.append(entry)
        offset = _align(offset + entry.nbytes, TENSOR_ALIGN)
    end = entries[-1].offset + entries[-1].nbytes if entries else 0
    if end > slot_bytes:
        raise ValueError(f"message of {end} bytes does not fit the cuda_ipc slot of "
                         f"{slot_bytes} bytes (the receiver sized it from its largest step)")
    return entries


def encode_descriptor(slot: int, entries: Sequence[SlotEntry]) -> torch.Tensor:
    """int64[2 + 11 * count]: slot, count, then each entry's dtype code, ndim, offset, dims."""
    values = [slot, len(entries)]
    for e in entries:
        dims = list(e.shape) + [0] * (MAX_NDIM - len(e.shape))
        values += [DTYPE_CODES[e.dtype], len(e.shape), e.offset, *dims]
    return torch.tensor(values, dtype=torch.int64)


def decode_descriptor(desc: Sequence[torch.Tensor], slots: int,
                      slot_bytes: int) -> tuple[int, list[SlotEntry]]:
    """The slot and entries of a data message, every field checked against the ring.

    Raises:
        ProtocolError: not a descriptor, or one pointing outside its slot.
    """
    if len(desc) != 1 or desc[0].dtype != torch.int64 or desc[0].dim() != 1:
        raise ProtocolError("cuda_ipc data message is not one int64 descriptor")
    values = desc[0].tolist()
    if len(values) < 2 or len(values) != 2 + ENTRY_WIDTH * values[1]:
        raise ProtocolError(f"cuda_ipc descriptor of {len(values)} values is malformed")
    slot, count = values[0], values[1]
    if not 0 <= slot < slots or count > MAX_TENSORS:
        raise ProtocolError(f"cuda_ipc descriptor names slot {slot} of {slots} and {count} "
                            "tensors")
    entries = []
    for i in range(count):
        code, ndim, offset, *dims = values[2 + i * ENTRY_WIDTH: 2 + (i + 1) * ENTRY_WIDTH]
        dtype = _CODE_DTYPES.get(code)
        if dtype is None or not 0 <= ndim <= MAX_NDIM or any(d < 0 for d in dims):
            raise ProtocolError(f"cuda_ipc descriptor entry {i}: dtype code {code}, ndim "
                                f"{ndim}, dims {dims}")
        entry = SlotEntry(dtype, tuple(dims[:ndim]), offset)
        if offset < 0 or offset % TENSOR_ALIGN or offset + entry.nbytes > slot_bytes:
            raise ProtocolError(f"cuda_ipc descriptor entry {i} ({entry.nbytes} bytes at "
                                f"{offset}) lies outside the {slot_bytes}-byte slot")
        entries.append(entry)
    return slot, entries


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

    def recv(self, expected_step_id: int, timeout_s: float | None = None
             ) -> list[torch.Tensor]:
        step_id, tensors = self.recv_any(timeout_s)
        if step_id != expected_step_id:
            raise StepMismatchError(expected_step_id, step_id)
        return tensors

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


# --- setup -------------------------------------------------------------------------------


class CudaIpcListener(LinkListener):
    """A `TcpListener` for the side link; each accepted peer gets a fresh ring."""

    def __init__(self, host: str, port: int = 0, *, token: bytes, ring: RingConfig,
                 config: DataPlaneConfig = _DEFAULT_CONFIG) -> None:
        reason = unavailable_reason(ring.device)
        if reason is not None:
            raise ValueError(f"cuda_ipc is not available here: {reason}")
        # The side link carries credits both ways, and a TLS link serialises its two
        # directions: it stays plain (the bytes never leave the host).
        self._tcp = TcpListener(host, port, token=token, config=replace(config, tls=None))
        self._ring = ring
        self._config = config

    @property
    def spec(self) -> LinkSpec:
        host, port = self._tcp.address
        return LinkSpec(TransportKind.CUDA_IPC, host, port, self._tcp.spec.token)

    def accept(self, timeout_s: float) -> CudaIpcReceiver:
        deadline = time.monotonic() + timeout_s
        while True:
            side = self._tcp.accept(max(deadline - time.monotonic(), 1e-3))
            try:
                return self._set_up(side, deadline)
            except (TransportError, ValueError) as e:
                side.close()
                logger.warning("cuda_ipc peer %s dropped during set-up: %s", side.peer, e)
                if time.monotonic() >= deadline:
                    raise TransportTimeout(f"no cuda_ipc peer set up within {timeout_s}s",
                                           link_closed=False) from e

    def _set_up(self, side: TcpTransport, deadline: float) -> CudaIpcReceiver:
        cfg = self._ring
        ring = _Ring(cfg)
        try:
            with torch.cuda.device(cfg.device):
                free = [torch.cuda.Event(interprocess=True) for _ in range(cfg.slots)]
                free_handles = [_handle_bytes(e.ipc_handle()) for e in free]
            meta = torch.tensor([SETUP_VERSION, cfg.slots, cfg.slot_bytes,
                                 _device_index(cfg.device)], dtype=torch.int64)
            timeout = max(deadline - time.monotonic(), 1e-3)
            side.send(0, [meta, _bytes_tensor(ring.handle), _bytes_tensor(*free_handles)],
                      timeout_s=timeout)
            step, answer = side.recv_any(max(deadline - time.monotonic(), 1e-3))
            handles = _handles(answer, cfg.slots, "ready-event")
            if step != 0:
                raise ProtocolError(f"cuda_ipc set-up answer for step {step}")
            with torch.cuda.device(cfg.device):
                ready = [torch.cuda.Event.from_ipc_handle(cfg.device, h) for h in handles]
        except BaseException:
            ring.retire()
            raise
        return CudaIpcReceiver(side, ring, free, ready)

    def close(self) -> None:
        self._tcp.close()


def connect(host: str, port: int, *, token: bytes, timeout_s: float, device: torch.device,
            config: DataPlaneConfig = _DEFAULT_CONFIG) -> CudaIpcSender:
    """Connect to a `CudaIpcListener`, present the token, map its ring on ``device``.

    Raises:
        LinkRefusedError: the token was refused, or the peer's memory cannot be mapped here
            (another host, or GPUs without IPC between them: link the hop over TCP).
        LinkUnreachableError, TransportTimeout, ProtocolError: as `TcpTransport.connect`.
    """
    reason = unavailable_reason(device)
    if reason is not None:
        raise LinkRefusedError(f"cuda_ipc is not available here: {reason}")
    deadline = time.monotonic() + timeout_s
    side = TcpTransport.connect(host, port, token=token, timeout_s=timeout_s,
                                config=replace(config, tls=None))  # see CudaIpcListener
    try:
        return _map_ring(side, device, deadline)
    except BaseException:
        side.close()
        raise


def _map_ring(side: TcpTransport, device: torch.device, deadline: float) -> CudaIpcSender:
    from cupy.cuda import runtime

    step, setup = side.recv_any(max(deadline - time.monotonic(), 1e-3))
    if step != 0 or len(setup) != 3 or setup[0].dtype != torch.int64 or setup[0].numel() != 4:
        raise ProtocolError("cuda_ipc set-up message is malformed")
    version, slots, slot_bytes, _peer_device = setup[0].tolist()
    if version != SETUP_VERSION or not 0 < slots <= 64 or slot_bytes <= 0:
        raise ProtocolError(f"cuda_ipc set-up: version {version}, {slots} slots of "
                            f"{slot_bytes} bytes")
    ring = RingConfig(device, slot_bytes, slots)  # this side's view; same sizes
    (mem_handle,) = _handles(setup[1:2], 1, "memory")
    free_handles = _handles(setup[2:], slots, "free-event")
    index = _device_index(device)
    try:
        with _on_device(index):
            ptr = int(runtime.ipcOpenMemHandle(mem_handle,
                                               _CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
    except Exception as e:  # cupy's CUDARuntimeError: another host, no peer access
        raise LinkRefusedError(f"cannot map the peer's cuda_ipc ring on {device}: {e}; the "
                               "two stages must share a host and GPU access (or link the "
                               "hop over tcp)") from e
    try:
        with torch.cuda.device(device):
            free = [torch.cuda.Event.from_ipc_handle(device, h) for h in free_handles]
            ready = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
            ready_handles = [_handle_bytes(e.ipc_handle()) for e in ready]
        side.send(0, [_bytes_tensor(*ready_handles)],
                  timeout_s=max(deadline - time.monotonic(), 1e-3))
        return CudaIpcSender(side, device, ptr, ring, free, ready)
    except BaseException:
        with contextlib.suppress(Exception), _on_device(index):
            runtime.ipcCloseMemHandle(ptr)
        raise


# --- small helpers ------------------------------------------------------------------------


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


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


def _handle_bytes(handle: Any) -> bytes:
    data = bytes(handle)
    if len(data) != IPC_HANDLE_BYTES:
        raise ValueError(f"IPC handle of {len(data)} bytes, expected {IPC_HANDLE_BYTES}")
    return data


def _bytes_tensor(*handles: bytes) -> torch.Tensor:
    """uint8[len(handles), 64] of raw handle bytes."""
    return torch.frombuffer(bytearray(b"".join(handles)), dtype=torch.uint8).view(
        len(handles), IPC_HANDLE_BYTES)


def _handles(tensors: Sequence[torch.Tensor], count: int, what: str) -> list[bytes]:
    """`count` raw handles from one uint8[count, 64] tensor."""
    if (len(tensors) != 1 or tensors[0].dtype != torch.uint8
            or tuple(tensors[0].shape) != (count, IPC_HANDLE_BYTES)):
        raise ProtocolError(f"cuda_ipc set-up: expected {count} {what} handle(s) of "
                            f"{IPC_HANDLE_BYTES} bytes")
    data = tensors[0].numpy().tobytes()
    return [data[i * IPC_HANDLE_BYTES:(i + 1) * IPC_HANDLE_BYTES] for i in range(count)]


__all__ = ["CudaIpcListener", "CudaIpcReceiver", "CudaIpcSender", "RingConfig", "connect",
           "decode_descriptor", "encode_descriptor", "layout", "unavailable_reason"]
