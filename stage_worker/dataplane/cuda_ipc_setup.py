"""Setting up a ``cuda_ipc`` link (see `stage_worker.dataplane.cuda_ipc` for the protocol):
the listener allocates a fresh ring per peer and exports its memory and *free*-event
handles; the connector maps the ring on its device and answers with its *ready*-event
handles. All over the plain TCP side link, as raw bytes."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from stage_worker.dataplane.config import DataPlaneConfig, TransportKind
from stage_worker.dataplane.cuda_ipc import (
    CudaIpcReceiver,
    CudaIpcSender,
    _device_index,
    _on_device,
    _Ring,
    unavailable_reason,
)
from stage_worker.dataplane.cuda_ipc_slots import RingConfig
from stage_worker.dataplane.side_link import (
    SideLinkListener,
    connect_side,
    raw_bytes,
    refuse_if_unavailable,
    time_left,
)
from stage_worker.dataplane.tcp import TcpTransport
from stage_worker.dataplane.transport import LinkRefusedError, ProtocolError

SETUP_VERSION = 1
IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t
_CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_DEFAULT_CONFIG = DataPlaneConfig()


class CudaIpcListener(SideLinkListener[CudaIpcReceiver]):
    """A `SideLinkListener`; each accepted peer gets a fresh ring. Raises ValueError where
    cuda_ipc is not available on the ring's device."""

    kind = TransportKind.CUDA_IPC

    def __init__(self, host: str, port: int = 0, *, token: bytes, ring: RingConfig,
                 config: DataPlaneConfig = _DEFAULT_CONFIG) -> None:
        refuse_if_unavailable(self.kind, unavailable_reason(ring.device), ValueError)
        super().__init__(host, port, token=token, config=config)
        self._ring = ring

    def _set_up(self, side: TcpTransport, deadline: float) -> CudaIpcReceiver:
        cfg = self._ring
        ring = _Ring(cfg)
        try:
            with torch.cuda.device(cfg.device):
                free = [torch.cuda.Event(interprocess=True) for _ in range(cfg.slots)]
                free_handles = [_handle_bytes(e.ipc_handle()) for e in free]
            meta = torch.tensor([SETUP_VERSION, cfg.slots, cfg.slot_bytes,
                                 _device_index(cfg.device)], dtype=torch.int64)
            side.send(0, [meta, _bytes_tensor(ring.handle), _bytes_tensor(*free_handles)],
                      timeout_s=time_left(deadline))
            step, answer = side.recv_any(time_left(deadline))
            handles = _handles(answer, cfg.slots, "ready-event")
            if step != 0:
                raise ProtocolError(f"cuda_ipc set-up answer for step {step}")
            with torch.cuda.device(cfg.device):
                ready = [torch.cuda.Event.from_ipc_handle(cfg.device, h) for h in handles]
        except BaseException:
            ring.retire()
            raise
        return CudaIpcReceiver(side, ring, free, ready)


def connect(host: str, port: int, *, token: bytes, timeout_s: float, device: torch.device,
            config: DataPlaneConfig = _DEFAULT_CONFIG) -> CudaIpcSender:
    """Connect to a `CudaIpcListener`, present the token, map its ring on ``device``.

    Raises:
        LinkRefusedError: the token was refused, or the peer's memory cannot be mapped here
            (another host, or GPUs without IPC between them: link the hop over TCP).
        LinkUnreachableError, TransportTimeout, ProtocolError: as `TcpTransport.connect`.
    """
    refuse_if_unavailable(TransportKind.CUDA_IPC, unavailable_reason(device), LinkRefusedError)
    return connect_side(host, port, token=token, timeout_s=timeout_s, config=config,
                        set_up=lambda side, deadline: _map_ring(side, device, deadline))


def _map_ring(side: TcpTransport, device: torch.device, deadline: float) -> CudaIpcSender:
    from cupy.cuda import runtime

    step, setup = side.recv_any(time_left(deadline))
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
        side.send(0, [_bytes_tensor(*ready_handles)], timeout_s=time_left(deadline))
        return CudaIpcSender(side, device, ptr, ring, free, ready)
    except BaseException:
        with contextlib.suppress(Exception), _on_device(index):
            runtime.ipcCloseMemHandle(ptr)
        raise


def _handle_bytes(handle: Any) -> bytes:
    data = bytes(handle)
    if len(data) != IPC_HANDLE_BYTES:
        raise ValueError(f"IPC handle of {len(data)} bytes, expected {IPC_HANDLE_BYTES}")
    return data


def _bytes_tensor(*handles: bytes) -> torch.Tensor:
    """uint8[len(handles), 64] of raw handle bytes."""
    return raw_bytes(b"".join(handles)).view(len(handles), IPC_HANDLE_BYTES)


def _handles(tensors: Sequence[torch.Tensor], count: int, what: str) -> list[bytes]:
    """`count` raw handles from one uint8[count, 64] tensor."""
    if (len(tensors) != 1 or tensors[0].dtype != torch.uint8
            or tuple(tensors[0].shape) != (count, IPC_HANDLE_BYTES)):
        raise ProtocolError(f"cuda_ipc set-up: expected {count} {what} handle(s) of "
                            f"{IPC_HANDLE_BYTES} bytes")
    data = tensors[0].numpy().tobytes()
    return [data[i * IPC_HANDLE_BYTES:(i + 1) * IPC_HANDLE_BYTES] for i in range(count)]
