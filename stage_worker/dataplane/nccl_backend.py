"""The NCCL calls of the ``nccl`` transport, behind one small interface (`NcclBackend`,
`NcclComm`): make a 2-rank communicator from a unique id, send and receive a byte tensor on
the link's CUDA stream, order that stream with the caller's, abort. `CupyNccl` is the real
one (cupy's NCCL bindings); the tests stand a double in for it. The protocol is in
`stage_worker.dataplane.nccl`."""

from __future__ import annotations

import functools
import logging
from typing import Any, Protocol

import torch

from stage_worker.dataplane.side_link import NO_CUPY
from stage_worker.dataplane.side_link import unavailable_reason as gpu_unavailable_reason

logger = logging.getLogger(__name__)


@functools.cache
def unavailable_reason(device: torch.device) -> str | None:
    """Why this process cannot offer ``nccl`` on ``device`` (None: it can): as for any GPU
    transport (`side_link.unavailable_reason`), and cupy must have been built with NCCL."""
    if (reason := gpu_unavailable_reason(device)) is not None:
        return reason
    try:
        from cupy.cuda import nccl
    except ImportError:
        return NO_CUPY
    if not getattr(nccl, "available", True):
        return "cupy was built without NCCL (cupy.cuda.nccl is not available)"
    return None


class NcclComm(Protocol):
    """One end of a 2-rank communicator and the CUDA stream its operations run on."""

    def order_after_caller(self) -> None:
        """Make the link's stream wait for the caller's current stream (an event)."""

    def send(self, data: torch.Tensor, peer: int) -> None:
        """Queue sending ``data`` (uint8, 1-D, contiguous, on the link's device) to ``peer``."""

    def recv(self, data: torch.Tensor, peer: int) -> None:
        """Queue receiving into ``data`` (uint8, 1-D, contiguous) from ``peer``."""

    def order_caller_after(self) -> None:
        """Make the caller's current stream wait for the link's stream (an event)."""

    def abort(self) -> None:
        """End the communicator and the operations still queued on it (idempotent)."""


class NcclBackend(Protocol):
    """Makes communicators: `CupyNccl`, or a stand-in in the tests."""

    def unique_id(self) -> bytes:
        """A fresh NCCL unique id (``ncclUniqueId``: 128 bytes)."""

    def communicator(self, unique_id: bytes, rank: int, device: torch.device) -> NcclComm:
        """Join the 2-rank communicator of ``unique_id`` as ``rank`` (blocks until the other
        rank joins too, as ``ncclCommInitRank``)."""


class CupyNccl:
    """The real backend: cupy's NCCL bindings, a torch stream per link."""

    def unique_id(self) -> bytes:
        from cupy.cuda import nccl

        # cupy 14 gives bytes; older ones a tuple of C chars (signed on x86-64)
        return bytes(b & 0xFF for b in nccl.get_unique_id())

    def communicator(self, unique_id: bytes, rank: int, device: torch.device) -> NcclComm:
        return _CupyComm(unique_id, rank, device)


def _communicator(nccl: Any, unique_id: bytes, rank: int) -> Any:
    """A 2-rank ``NcclCommunicator``: cupy 14 takes the id as bytes, older ones as a tuple
    of C chars (signed on x86-64, unsigned on aarch64)."""
    try:
        return nccl.NcclCommunicator(2, unique_id, rank)
    except TypeError:
        pass
    try:
        return nccl.NcclCommunicator(2, tuple(b - 256 if b > 127 else b for b in unique_id),
                                     rank)
    except OverflowError:
        return nccl.NcclCommunicator(2, tuple(unique_id), rank)


class _CupyComm:
    def __init__(self, unique_id: bytes, rank: int, device: torch.device) -> None:
        import cupy
        from cupy.cuda import nccl

        self._device = device
        self._dtype = nccl.NCCL_UINT8
        index = device.index if device.index is not None else torch.cuda.current_device()
        with cupy.cuda.Device(index), torch.cuda.device(index):
            self._stream = torch.cuda.Stream(device)
            self._comm = _communicator(nccl, unique_id, rank)
        self._aborted = False

    def order_after_caller(self) -> None:
        self._stream.wait_stream(torch.cuda.current_stream(self._device))

    def send(self, data: torch.Tensor, peer: int) -> None:
        self._comm.send(data.data_ptr(), data.numel(), self._dtype, peer,
                        self._stream.cuda_stream)

    def recv(self, data: torch.Tensor, peer: int) -> None:
        self._comm.recv(data.data_ptr(), data.numel(), self._dtype, peer,
                        self._stream.cuda_stream)

    def order_caller_after(self) -> None:
        torch.cuda.current_stream(self._device).wait_stream(self._stream)

    def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        try:
            self._comm.abort()
        except Exception as e:  # already torn down by NCCL itself: nothing left to end
            logger.debug("nccl abort: %s", e)
