"""TLS and mutual TLS on the gRPC hops (client -> router, gateway -> router, router ->
stages). Certificates are PEM files read once at start; a missing or unreadable file is a
one-line error naming the flag. Under a service mesh its proxies provide mTLS instead
(docs/DEPLOY.md); Kubernetes' native gRPC probes cannot speak TLS."""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsConfigError(ValueError):
    """Inconsistent TLS flags or an unreadable PEM file; the message names the flag."""


def _read(path: Path, flag: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TlsConfigError(f"{flag}: cannot read {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise TlsConfigError(f"{flag}: {path} is not a PEM file")
    return data


@dataclass(frozen=True)
class ServerTls:
    """A listener's PEM certificate chain and key; with `client_ca`, clients must present a
    certificate it signed (mutual TLS)."""

    cert: bytes
    key: bytes
    client_ca: bytes | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)],
                                           root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


@dataclass(frozen=True)
class ClientTls:
    """How a client verifies its server (PEM `ca`; None = the system roots) and, for mutual
    TLS, the PEM certificate and key it presents."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def _read_optional(path: Path | None, flag: str) -> bytes | None:
    return None if path is None else _read(path, flag)


def server_tls(cert: Path | None, key: Path | None, client_ca: Path | None,
               flag_prefix: str = "--tls") -> ServerTls | None:
    """ServerTls from the flags' files (read now, once), None when none is given."""
    p = flag_prefix
    if cert is None and key is None:
        if client_ca is not None:
            raise TlsConfigError(f"{p}-client-ca needs {p}-cert and {p}-key")
        return None
    if cert is None or key is None:
        raise TlsConfigError(f"{p}-cert and {p}-key go together")
    return ServerTls(_read(cert, f"{p}-cert"), _read(key, f"{p}-key"),
                     _read_optional(client_ca, f"{p}-client-ca"))


def client_tls(ca: Path | None, cert: Path | None, key: Path | None,
               flag_prefix: str = "--tls") -> ClientTls | None:
    """ClientTls from the flags' files (read now, once), None when none is given."""
    p = flag_prefix
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise TlsConfigError(f"{p}-cert and {p}-key go together")
    return ClientTls(_read_optional(ca, f"{p}-ca"), _read_optional(cert, f"{p}-cert"),
                     _read_optional(key, f"{p}-key"))


class ListenError(RuntimeError):
    """A gRPC listener could not bind its address."""


def add_port(server: grpc.aio.Server, host: str, port: int, tls: ServerTls | None) -> int:
    """Bind `host:port` on `server` (TLS when `tls` is given); returns the bound port."""
    listen = f"{host}:{port}"
    try:
        if tls is not None:
            return int(server.add_secure_port(listen, tls.credentials()))
        return int(server.add_insecure_port(listen))
    except RuntimeError as e:
        raise ListenError(f"cannot listen on {listen}: the port is in use or the address is "
                          "not one of this machine's; choose another --host/--port") from e


def refuse_if_taken(host: str, port: int) -> None:
    """Raise ListenError when a socket already holds `host:port`.

    For a listener that sets SO_REUSEPORT (the router's fronts share their port): its own
    bind succeeds beside any other reuse-port listener of the same user on that port, such
    as another router's, and the kernel then splits the connections between the two. A
    plain bind beside it fails instead. Port 0 (any free one) is never taken; an address
    that does not resolve is left to `add_port` to name.
    """
    if not port:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            try:
                probe.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ListenError(f"cannot listen on {host}:{port}: the port is in use; "
                                      "choose another --host/--port") from None
