"""Setting up an ``nccl`` link (see `stage_worker.dataplane.nccl` for the protocol): the
listener draws a fresh NCCL unique id per peer and sends it with a versioned meta header
over the TCP side link; the connector answers that it joins; both make the 2-rank
communicator (listener rank 0, connector rank 1). Raw bytes, never pickled."""

from __future__ import annotations

from collections.abc import Callable

import torch

from stage_worker.dataplane.config import DataPlaneConfig, TransportKind
from stage_worker.dataplane.nccl import DEFAULT_CREDITS, NcclReceiver, NcclSender
from stage_worker.dataplane.nccl_backend import (
    CupyNccl,
    NcclBackend,
    NcclComm,
    unavailable_reason,
)
from stage_worker.dataplane.side_link import (
    SideLinkListener,
    connect_side,
    raw_bytes,
    refuse_if_unavailable,
    time_left,
)
from stage_worker.dataplane.tcp import TcpTransport
from stage_worker.dataplane.transport import LinkClosedError, LinkRefusedError, ProtocolError

SETUP_VERSION = 1
UNIQUE_ID_BYTES = 128  # ncclUniqueId
MAX_CREDITS = 64
_DEFAULT_CONFIG = DataPlaneConfig()


def _check_here(device: torch.device, backend: NcclBackend | None,
                error: Callable[[str], Exception]) -> NcclBackend:
    """The backend to use: the real one where NCCL works on ``device`` (else ``error``); a
    given one as is."""
    if backend is not None:
        return backend
    refuse_if_unavailable(TransportKind.NCCL, unavailable_reason(device), error)
    return CupyNccl()


class NcclListener(SideLinkListener[NcclReceiver]):
    """A `SideLinkListener`; each accepted peer gets a fresh communicator.

    Args:
        device: where received tensors are allocated (this stage's device).
        credits: messages in flight at most (the receiver returns one per message taken up).
        backend: the NCCL calls (None: cupy's; the tests pass a stand-in).

    Raises:
        ValueError: credits out of range, or nccl not available on ``device``.
    """

    kind = TransportKind.NCCL

    def __init__(self, host: str, port: int = 0, *, token: bytes, device: torch.device,
                 config: DataPlaneConfig = _DEFAULT_CONFIG, credits: int = DEFAULT_CREDITS,
                 backend: NcclBackend | None = None) -> None:
        if not 0 < credits <= MAX_CREDITS:
            raise ValueError(f"credits must be in 1..{MAX_CREDITS}, got {credits}")
        self._backend = _check_here(device, backend, ValueError)
        super().__init__(host, port, token=token, config=config)
        self._device = device
        self._credits = credits

    def _set_up(self, side: TcpTransport, deadline: float) -> NcclReceiver:
        unique_id = self._backend.unique_id()
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"NCCL unique id of {len(unique_id)} bytes")
        index = self._device.index if self._device.index is not None else -1
        meta = torch.tensor([SETUP_VERSION, self._credits, index, len(unique_id)],
                            dtype=torch.int64)
        side.send(0, [meta, raw_bytes(unique_id)], timeout_s=time_left(deadline))
        step, answer = side.recv_any(time_left(deadline))
        if step != 0 or answer:
            raise ProtocolError(f"nccl join answer for step {step} with {len(answer)} tensors")
        comm = _join(self._backend, unique_id, 0, self._device)
        return NcclReceiver(side, comm, self._device, self._config.max_message_bytes)


def connect(host: str, port: int, *, token: bytes, timeout_s: float, device: torch.device,
            config: DataPlaneConfig = _DEFAULT_CONFIG,
            backend: NcclBackend | None = None) -> NcclSender:
    """Connect to an `NcclListener`, present the token, join its communicator on ``device``.

    Raises:
        LinkRefusedError: the token was refused (a stale epoch's included), or NCCL is not
            available here.
        LinkUnreachableError, TransportTimeout, ProtocolError: as `TcpTransport.connect`.
        LinkClosedError: the communicator could not be made (the peer went away).
    """
    backend = _check_here(device, backend, LinkRefusedError)

    def join(side: TcpTransport, deadline: float) -> NcclSender:
        step, setup = side.recv_any(time_left(deadline))
        unique_id, credits = _read_setup(step, setup)
        side.send(0, [], timeout_s=time_left(deadline))  # joining
        return NcclSender(side, _join(backend, unique_id, 1, device), device, credits)

    return connect_side(host, port, token=token, timeout_s=timeout_s, config=config,
                        set_up=join)


def _read_setup(step: int, setup: list[torch.Tensor]) -> tuple[bytes, int]:
    """(unique id, credits) from the listener's set-up message, every field checked."""
    if (step != 0 or len(setup) != 2 or setup[0].dtype != torch.int64
            or tuple(setup[0].shape) != (4,) or setup[1].dtype != torch.uint8
            or setup[1].dim() != 1):
        raise ProtocolError("nccl set-up message is malformed")
    version, credits, _peer_device, id_bytes = setup[0].tolist()
    if (version != SETUP_VERSION or not 0 < credits <= MAX_CREDITS
            or id_bytes != UNIQUE_ID_BYTES or setup[1].numel() != id_bytes):
        raise ProtocolError(f"nccl set-up: version {version}, {credits} credits, a unique id "
                            f"of {id_bytes} bytes")
    return setup[1].numpy().tobytes(), credits


def _join(backend: NcclBackend, unique_id: bytes, rank: int, device: torch.device
          ) -> NcclComm:
    try:
        return backend.communicator(unique_id, rank, device)
    except Exception as e:  # cupy's NcclError: the peer went away, no route between hosts
        raise LinkClosedError(f"cannot make the nccl communicator (rank {rank} on {device}): "
                              f"{e}") from e
