"""Credentials on the command line: TLS for a listener and towards a peer, API keys, and
the pipeline's pairing secret. Each flag also reads the environment (Kubernetes sets it), and
each reader turns a bad file into one `stagemesh <command>:` line."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from foundation.tls import ClientTls, ServerTls


def add_server_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", type=Path, default=env_path("STAGEMESH_TLS_CERT"),
                   help="PEM certificate (chain) of this listener; with --tls-key it serves "
                        "TLS only [$STAGEMESH_TLS_CERT]")
    p.add_argument("--tls-key", type=Path, default=env_path("STAGEMESH_TLS_KEY"),
                   help="PEM private key of --tls-cert [$STAGEMESH_TLS_KEY]")
    p.add_argument("--tls-client-ca", type=Path, default=env_path("STAGEMESH_TLS_CLIENT_CA"),
                   help="PEM CA: clients must present a certificate it signed (mutual TLS) "
                        "[$STAGEMESH_TLS_CLIENT_CA]")


def add_client_tls_args(p: argparse.ArgumentParser, peer: str) -> None:
    """--<peer>-tls-ca/-cert/-key: how this process reaches <peer> over TLS."""
    env = f"STAGEMESH_{peer.upper()}_TLS"
    p.add_argument(f"--{peer}-tls-ca", type=Path, default=env_path(f"{env}_CA"),
                   help=f"PEM CA that signed the {peer}'s certificate; any --{peer}-tls-* "
                        f"flag turns TLS on (system roots without this one) [${env}_CA]")
    p.add_argument(f"--{peer}-tls-cert", type=Path, default=env_path(f"{env}_CERT"),
                   help=f"client certificate for mutual TLS with the {peer} [${env}_CERT]")
    p.add_argument(f"--{peer}-tls-key", type=Path, default=env_path(f"{env}_KEY"),
                   help=f"private key of --{peer}-tls-cert [${env}_KEY]")


def add_stage_token_arg(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--stage-token-file", type=Path, default=None,
                   help=f"file holding the pipeline's pairing secret: {role} "
                        "[$STAGEMESH_STAGE_TOKEN holds the secret itself; `serve` makes one]")


def stage_token_of(args: argparse.Namespace) -> str:
    """The pairing secret: --stage-token-file's content, else $STAGEMESH_STAGE_TOKEN, else
    none ("")."""
    from foundation.grpc_auth import STAGE_TOKEN_ENV

    if args.stage_token_file is not None:
        try:
            token = args.stage_token_file.read_text().strip()
        except OSError as e:
            raise SystemExit(f"stagemesh {args.command}: --stage-token-file: {e}") from None
        if not token:
            raise SystemExit(f"stagemesh {args.command}: --stage-token-file "
                             f"{args.stage_token_file} is empty")
        return token
    return os.environ.get(STAGE_TOKEN_ENV, "").strip()


def env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def server_tls_of(args: argparse.Namespace) -> ServerTls | None:
    from foundation.tls import TlsConfigError, server_tls

    try:
        return server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
    except TlsConfigError as e:
        raise SystemExit(f"stagemesh {args.command}: {e}") from None


def client_tls_of(args: argparse.Namespace, peer: str) -> ClientTls | None:
    from foundation.tls import TlsConfigError, client_tls

    attr = peer.replace("-", "_")
    try:
        return client_tls(getattr(args, f"{attr}_tls_ca"), getattr(args, f"{attr}_tls_cert"),
                          getattr(args, f"{attr}_tls_key"), f"--{peer}-tls")
    except TlsConfigError as e:
        raise SystemExit(f"stagemesh {args.command}: {e}") from None


def add_api_key_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", default=[],
                   help="accepted bearer key (repeatable; also $STAGEMESH_API_KEYS, "
                        "comma-separated, and --api-key-file); none = no authentication")
    p.add_argument("--api-key-file", type=Path, default=None,
                   help="file with one API key per line ('#' comments)")


def api_keys(args: argparse.Namespace) -> frozenset[str]:
    """The keys from --api-key, $STAGEMESH_API_KEYS and --api-key-file."""
    from foundation.api_keys import load_api_keys

    try:
        return load_api_keys(args.api_key, os.environ.get("STAGEMESH_API_KEYS"),
                             args.api_key_file)
    except OSError as e:
        raise SystemExit(f"stagemesh {args.command}: cannot read --api-key-file: {e}") from None
