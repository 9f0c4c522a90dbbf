"""TLS and mutual TLS on the gRPC hops (client -> router, gateway -> router, router ->
stages). Certificates are PEM files read once at start; a missing or unreadable file is a
one-line error naming the flag. Under a service mesh its proxies provide mTLS instead
(docs/DEPLOY.md); Kubernetes' native gRPC probes cannot speak TLS."""

from __future__ import annotations

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
    """A listener's certificate and key; with `client_ca`, clients must present a certificate
    it signed (mutual TLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None
    flag_prefix: str = "--tls"

    def credentials(self) -> grpc.ServerCredentials:
        p = self.flag_prefix
        pair = (_read(self.key, f"{p}-key"), _read(self.cert, f"{p}-cert"))
        roots = None if self.client_ca is None else _read(self.client_ca, f"{p}-client-ca")
        return grpc.ssl_server_credentials([pair], root_certificates=roots,
                                           require_client_auth=roots is not None)


@dataclass(frozen=True)
class ClientTls:
    """How a client verifies its server (`ca`; None = the system roots) and, for mutual
    TLS, the certificate and key it presents."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    flag_prefix: str = "--tls"

    def credentials(self) -> grpc.ChannelCredentials:
        p = self.flag_prefix
        return grpc.ssl_channel_credentials(
            root_certificates=None if self.ca is None else _read(self.ca, f"{p}-ca"),
            private_key=None if self.key is None else _read(self.key, f"{p}-key"),
            certificate_chain=None if self.cert is None else _read(self.cert, f"{p}-cert"))


def server_tls(cert: Path | None, key: Path | None, client_ca: Path | None,
               flag_prefix: str = "--tls") -> ServerTls | None:
    """ServerTls from the flags, None when none is given."""
    p = flag_prefix
    if cert is None and key is None:
        if client_ca is not None:
            raise TlsConfigError(f"{p}-client-ca needs {p}-cert and {p}-key")
        return None
    if cert is None or key is None:
        raise TlsConfigError(f"{p}-cert and {p}-key go together")
    tls = ServerTls(cert, key, client_ca, flag_prefix)
    tls.credentials()  # read every file now: a bad path fails at start, naming its flag
    return tls


def client_tls(ca: Path | None, cert: Path | None, key: Path | None,
               flag_prefix: str = "--tls") -> ClientTls | None:
    """ClientTls from the flags, None when none is given (plaintext)."""
    p = flag_prefix
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise TlsConfigError(f"{p}-cert and {p}-key go together")
    tls = ClientTls(ca, cert, key, flag_prefix)
    tls.credentials()
    return tls


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
