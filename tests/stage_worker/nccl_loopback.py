"""`LoopbackNccl`: a test double that stands in for NCCL, and for NCCL only.

It implements `stage_worker.dataplane.nccl_backend.NcclBackend` in one process: the two ranks of a
communicator share a queue per direction, ``send`` puts a copy of the bytes, ``recv`` takes
them (blocking, bounded) and ``abort`` wakes a blocked ``recv`` with an error, as
``ncclCommAbort`` ends queued operations. Streams are not modelled (CPU tensors). Everything
else a test of the ``nccl`` transport exercises is the real code: the TCP side link, the
token check, the set-up message, the descriptors, credits and step checks.
"""

from __future__ import annotations

import queue
import secrets
import threading

import torch

from stage_worker.dataplane.nccl_backend import NcclComm

RECV_WAIT_S = 10.0  # a receive whose bytes never come fails the test instead of hanging


class _Pair:
    """What the two ranks of one communicator share: the bytes in flight to each rank."""

    def __init__(self) -> None:
        self.to_rank: tuple[queue.Queue[torch.Tensor | None], ...] = (queue.Queue(),
                                                                       queue.Queue())


class LoopbackComm:
    """One rank's end. Counts what it was asked to do, for the tests."""

    def __init__(self, pair: _Pair, rank: int) -> None:
        self._pair = pair
        self.rank = rank
        self.sent = self.received = self.orders = 0
        self.aborted = False

    def order_after_caller(self) -> None:
        self.orders += 1

    def order_caller_after(self) -> None:
        self.orders += 1

    def send(self, data: torch.Tensor, peer: int) -> None:
        assert data.dtype == torch.uint8 and data.dim() == 1 and data.is_contiguous()
        if self.aborted:
            raise RuntimeError("loopback NCCL: communicator aborted")
        self._pair.to_rank[peer].put(data.clone())
        self.sent += 1

    def recv(self, data: torch.Tensor, peer: int) -> None:
        assert data.dtype == torch.uint8 and data.dim() == 1 and data.is_contiguous()
        try:
            got = self._pair.to_rank[self.rank].get(timeout=RECV_WAIT_S)
        except queue.Empty:
            raise RuntimeError("loopback NCCL: nothing arrived") from None
        if got is None or self.aborted:
            raise RuntimeError("loopback NCCL: communicator aborted")
        if got.numel() != data.numel():  # real NCCL would hang or corrupt: fail loudly
            raise RuntimeError(f"loopback NCCL: {got.numel()} bytes sent, {data.numel()} "
                               "expected")
        data.copy_(got)
        self.received += 1

    def abort(self) -> None:
        self.aborted = True
        for q in self._pair.to_rank:
            q.put(None)


class LoopbackNccl:
    """The backend: unique ids are 128 random bytes; each id names one communicator."""

    def __init__(self) -> None:
        self._pairs: dict[bytes, _Pair] = {}
        self._lock = threading.Lock()
        self.ids: list[bytes] = []  # drawn, in order
        self.comms: list[LoopbackComm] = []  # joined, in order

    def unique_id(self) -> bytes:
        uid = secrets.token_bytes(128)
        self.ids.append(uid)
        return uid

    def communicator(self, unique_id: bytes, rank: int, device: torch.device) -> NcclComm:
        assert device.type == "cpu"
        with self._lock:
            pair = self._pairs.setdefault(unique_id, _Pair())
            comm = LoopbackComm(pair, rank)
            self.comms.append(comm)
        return comm
