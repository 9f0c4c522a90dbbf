"""Create either end of a link from a `LinkSpec`, whatever its transport kind.

The stage service calls `open_listener` for its upstream link (and reports ``listener.spec``
over the control channel) and `open_link` for its downstream link, with the spec that its
``Connect`` RPC carried.
"""

from __future__ import annotations

from stage_worker.dataplane.config import DataPlaneConfig, LinkSpec, TransportKind
from stage_worker.dataplane.tcp import TcpListener, TcpTransport
from stage_worker.dataplane.transport import LinkListener, Transport

_DEFAULT_CONFIG = DataPlaneConfig()


def open_listener(spec: LinkSpec, *, config: DataPlaneConfig = _DEFAULT_CONFIG) -> LinkListener:
    """Start the accepting end of a link: bind ``spec.host:spec.port`` (0 picks a port).

    Returns:
        A listener; its ``spec`` carries the bound port and the token, for the peer.

    Raises:
        OSError: the address cannot be bound.
        NotImplementedError: a transport kind this build does not implement.
    """
    if spec.kind is TransportKind.TCP:
        return TcpListener(spec.host, spec.port, token=spec.token, config=config)
    raise NotImplementedError(f"transport {spec.kind.value} is not implemented")


def open_link(
    spec: LinkSpec, *, timeout_s: float, config: DataPlaneConfig = _DEFAULT_CONFIG
) -> Transport:
    """Connect to the listener described by ``spec`` and authenticate with its token.

    Args:
        spec: the peer listener's kind, address and token (``port`` must be its real port).
        timeout_s: upper bound on connecting plus the handshake.
        config: local limits of this end.

    Returns:
        The linked transport.

    Raises:
        ValueError: ``spec.port`` is 0.
        LinkUnreachableError, LinkRefusedError, TransportTimeout: see `TcpTransport.connect`.
        NotImplementedError: a transport kind this build does not implement.
    """
    if spec.port == 0:
        raise ValueError("cannot connect to port 0: pass the listener's reported spec")
    if spec.kind is TransportKind.TCP:
        return TcpTransport.connect(
            spec.host, spec.port, token=spec.token, timeout_s=timeout_s, config=config
        )
    raise NotImplementedError(f"transport {spec.kind.value} is not implemented")
