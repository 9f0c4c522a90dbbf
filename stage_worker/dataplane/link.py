"""Create either end of a link from a `LinkSpec`, whatever its transport kind.

The stage service calls `open_listener` for its upstream link (and reports ``listener.spec``
over the control channel) and `open_link` for its downstream link, with the spec that its
``Connect`` RPC carried.
"""

from __future__ import annotations

import torch

from stage_worker.dataplane import cuda_ipc_setup, nccl_setup, unix
from stage_worker.dataplane.config import DataPlaneConfig, LinkSpec, TransportKind
from stage_worker.dataplane.cuda_ipc_slots import RingConfig
from stage_worker.dataplane.tcp import TcpListener, TcpTransport
from stage_worker.dataplane.transport import LinkListener, Transport

_DEFAULT_CONFIG = DataPlaneConfig()


def open_listener(spec: LinkSpec, *, config: DataPlaneConfig = _DEFAULT_CONFIG,
                  ring: RingConfig | None = None,
                  device: torch.device | None = None) -> LinkListener:
    """Start the accepting end of a link: bind ``spec.host:spec.port`` (0 picks a port);
    ``unix``: a fresh abstract name (``spec.host`` is not read).

    Args:
        ring: for ``cuda_ipc``, the receiving ring (device, slot size) each peer gets.
        device: for ``nccl``, the receiver's device.

    Returns:
        A listener; its ``spec`` carries the bound port and the token, for the peer.

    Raises:
        OSError: the address cannot be bound.
        ValueError: ``cuda_ipc`` without a ring, ``nccl`` without a device, or either not
            available in this process.
        NotImplementedError: a transport kind this build does not implement.
    """
    if spec.kind is TransportKind.TCP:
        return TcpListener(spec.host, spec.port, token=spec.token, config=config)
    if spec.kind is TransportKind.UNIX:
        return unix.UnixListener(token=spec.token, config=config)
    if spec.kind is TransportKind.CUDA_IPC:
        if ring is None:
            raise ValueError("a cuda_ipc listener needs its ring (device and slot size)")
        return cuda_ipc_setup.CudaIpcListener(spec.host, spec.port, token=spec.token, ring=ring,
                                        config=config)
    if spec.kind is TransportKind.NCCL:
        if device is None:
            raise ValueError("an nccl listener needs the receiver's device")
        return nccl_setup.NcclListener(spec.host, spec.port, token=spec.token, device=device,
                                       config=config)
    raise NotImplementedError(f"transport {spec.kind.value} is not implemented")


def open_link(
    spec: LinkSpec, *, timeout_s: float, config: DataPlaneConfig = _DEFAULT_CONFIG,
    device: torch.device | None = None,
) -> Transport:
    """Connect to the listener described by ``spec`` and authenticate with its token.

    Args:
        spec: the peer listener's kind, address and token (``port`` must be its real port;
            ``unix``: ``host`` is its "unix:@<name>").
        timeout_s: upper bound on connecting plus the handshake.
        config: local limits of this end.
        device: for ``cuda_ipc`` and ``nccl``, the sender's device (where its tensors are).

    Returns:
        The linked transport.

    Raises:
        ValueError: ``spec.port`` is 0 (``unix``: a malformed address).
        LinkUnreachableError, LinkRefusedError, TransportTimeout: see `TcpTransport.connect`
            (``cuda_ipc`` also refuses when the peer's ring cannot be mapped here).
        LinkClosedError: ``nccl``: the communicator could not be made.
        NotImplementedError: a transport kind this build does not implement.
    """
    if spec.kind is TransportKind.UNIX:
        return unix.connect(spec.host, token=spec.token, timeout_s=timeout_s, config=config)
    if spec.port == 0:
        raise ValueError("cannot connect to port 0: pass the listener's reported spec")
    if spec.kind is TransportKind.TCP:
        return TcpTransport.connect(
            spec.host, spec.port, token=spec.token, timeout_s=timeout_s, config=config
        )
    if spec.kind is TransportKind.CUDA_IPC:
        if device is None:
            raise ValueError("a cuda_ipc link needs the sender's device")
        return cuda_ipc_setup.connect(spec.host, spec.port, token=spec.token, timeout_s=timeout_s,
                                device=device, config=config)
    if spec.kind is TransportKind.NCCL:
        if device is None:
            raise ValueError("an nccl link needs the sender's device")
        return nccl_setup.connect(spec.host, spec.port, token=spec.token, timeout_s=timeout_s,
                                  device=device, config=config)
    raise NotImplementedError(f"transport {spec.kind.value} is not implemented")
