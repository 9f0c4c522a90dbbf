"""The data plane: activations between neighbouring pipeline stages, never over gRPC.

One `Transport` contract (``transport.py``), one wire format (``wire.py``), and four
implementations: ``tcp`` (any two hosts, CPU or GPU; activations through host memory),
``unix`` (the same stream on a Unix-domain socket, between processes of one host and network
namespace, ``unix.py``), ``cuda_ipc`` (stages on one host: device memory to device memory,
``cuda_ipc.py``) and ``nccl`` (GPUs on different hosts: a 2-rank NCCL communicator per link,
``nccl.py``).
"""

from stage_worker.dataplane.config import (
    DataPlaneConfig,
    LinkSpec,
    TransportKind,
    new_link_token,
)
from stage_worker.dataplane.link import open_link, open_listener
from stage_worker.dataplane.tcp import TcpListener, TcpTransport
from stage_worker.dataplane.transport import (
    LinkClosedError,
    LinkListener,
    LinkRefusedError,
    LinkUnreachableError,
    ProtocolError,
    StepMismatchError,
    Transport,
    TransportError,
    TransportTimeout,
)

__all__ = [
    "DataPlaneConfig",
    "LinkClosedError",
    "LinkListener",
    "LinkRefusedError",
    "LinkSpec",
    "LinkUnreachableError",
    "ProtocolError",
    "StepMismatchError",
    "TcpListener",
    "TcpTransport",
    "Transport",
    "TransportError",
    "TransportKind",
    "TransportTimeout",
    "new_link_token",
    "open_link",
    "open_listener",
]
