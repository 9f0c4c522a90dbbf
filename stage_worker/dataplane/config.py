"""What a data-plane link is (`LinkSpec`, carried by the control plane) and how it behaves
locally (`DataPlaneConfig`, set once per stage)."""

from __future__ import annotations

import enum
import secrets
import ssl
from dataclasses import dataclass, field
from pathlib import Path

# A link token is the only secret of a data-plane link; bounded so a handshake stays tiny.
MIN_TOKEN_BYTES = 16
MAX_TOKEN_BYTES = 256

# 2 GiB: far above one step's activations ([T, H] bf16 with T = 8192, H = 8192 is 128 MiB),
# low enough that a peer cannot make us allocate unbounded memory.
DEFAULT_MAX_MESSAGE_BYTES = 2 << 30


class TransportKind(enum.Enum):
    """How the bytes move. Chosen per hop by the launcher; see ARCHITECTURE.md, "The data plane".

    """

    TCP = "tcp"
    CUDA_IPC = "cuda_ipc"
    NCCL = "nccl"
    UNIX = "unix"


def new_link_token() -> bytes:
    """A fresh random per-link token (32 bytes), to hand out over the control channel."""
    return secrets.token_bytes(32)


def check_token(token: bytes) -> None:
    """Raise ValueError unless ``token`` is bytes of an acceptable length."""
    if not isinstance(token, bytes):
        raise ValueError(f"link token must be bytes, got {type(token).__name__}")
    if not MIN_TOKEN_BYTES <= len(token) <= MAX_TOKEN_BYTES:
        raise ValueError(
            f"link token must be {MIN_TOKEN_BYTES}..{MAX_TOKEN_BYTES} bytes, got {len(token)}"
        )


@dataclass(frozen=True)
class LinkSpec:
    """Everything one end needs to reach the other: what a ``Connect`` RPC carries.

    Attributes:
        kind: the transport.
        host: the listener's address (an IP or name; a listener binds exactly this, never a
            wildcard unless one is given explicitly); ``unix``: "unix:@<name>" (the listener
            picks it; its ``spec`` reports it).
        port: the listener's port; 0 asks the listener to pick one (its ``spec`` reports it);
            ``unix``: 0 (none).
        token: the per-link secret the connector must present (never printed in ``repr``).
    """

    kind: TransportKind
    host: str
    port: int
    token: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, TransportKind):
            raise ValueError(f"kind must be a TransportKind, got {self.kind!r}")
        if not self.host:
            raise ValueError("host must be given (listeners never default to a wildcard)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        check_token(self.token)


@dataclass(frozen=True)
class DataPlaneTls:
    """TLS on TCP data-plane links, for links that cross hosts.

    The accepting stage presents its certificate (``server``); the connecting stage checks
    that certificate against the CA and the name it dialled (``client``), so activations and
    the link token go only to the stage the router named. The connector is authenticated by
    the link token inside the encrypted stream, as on plain TCP. Build with `load`.
    """

    server: ssl.SSLContext
    client: ssl.SSLContext

    @classmethod
    def load(cls, cert: Path, key: Path, ca: Path) -> DataPlaneTls:
        """Contexts from PEM files: this stage's certificate chain and key, and the CA that
        signed the other stages' certificates. Raises ValueError naming the file that
        cannot be used."""
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies chain and host name
        for ctx in (server, client):
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            server.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"data-plane TLS: cannot load {cert} / {key}: {e}") from None
        try:
            client.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"data-plane TLS: cannot load the CA {ca}: {e}") from None
        return cls(server, client)


@dataclass(frozen=True)
class DataPlaneConfig:
    """Local limits and timeouts of this stage's data-plane links.

    Attributes:
        max_message_bytes: largest message (header + payload) sent or accepted; a peer that
            announces more is refused before anything is allocated.
        handshake_timeout_s: how long a listener waits for one connecting peer's hello before
            refusing it, and how long a connector waits for the verdict at most.
        tcp_keepalive_idle_s: TCP keepalive probes start after this much silence, so a peer
            whose host vanished (no FIN, no RST) is detected even by an unbounded ``recv``
            (after idle + 3 probes x interval). None disables keepalive.
        tcp_keepalive_interval_s: seconds between keepalive probes.
        tls: TLS on the stage's TCP links (None: plaintext; see `DataPlaneTls`).
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    handshake_timeout_s: float = 5.0
    tcp_keepalive_idle_s: int | None = 10
    tcp_keepalive_interval_s: int = 5
    tls: DataPlaneTls | None = None

    def __post_init__(self) -> None:
        if self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be > 0, got {self.max_message_bytes}")
        if self.handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {self.handshake_timeout_s}")
        if self.tcp_keepalive_idle_s is not None and self.tcp_keepalive_idle_s < 1:
            raise ValueError(f"tcp_keepalive_idle_s must be >= 1, got {self.tcp_keepalive_idle_s}")
        if self.tcp_keepalive_interval_s < 1:
            raise ValueError(
                f"tcp_keepalive_interval_s must be >= 1, got {self.tcp_keepalive_interval_s}"
            )
