"""`stagemesh gateway`: argument parsing only. Addresses come from flags or the
environment, as for the other services (`stagemesh.cli_services`, `stagemesh.cli_stage`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from stagemesh.cli_credentials import add_api_key_args, add_client_tls_args, api_keys, client_tls_of
from stagemesh.cli_flags import (
    SubParsers,
    add_drain_timeout_arg,
    add_tracing_arg,
    at_least_one,
    env,
    port,
    positive_seconds,
)

if TYPE_CHECKING:
    from gateway.config import GatewayConfig


def add_gateway(commands: SubParsers) -> None:
    from gateway.config import DEFAULT_MAX_BODY_BYTES

    p = commands.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway")
    p.add_argument("--router", default=env("STAGEMESH_ROUTER", "127.0.0.1:50051"),
                   help="the router's gRPC address [$STAGEMESH_ROUTER]")
    p.add_argument("--host", default=env("STAGEMESH_GATEWAY_HOST", "127.0.0.1"),
                   help="HTTP listener address [$STAGEMESH_GATEWAY_HOST]")
    p.add_argument("--port", type=port, default=int(env("STAGEMESH_GATEWAY_PORT", "8000")),
                   help="HTTP port, 0 = any free one [$STAGEMESH_GATEWAY_PORT]")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="write the bound host:port here once serving")
    add_api_key_args(p)
    add_client_tls_args(p, "router")
    p.add_argument("--router-api-key", default=env("STAGEMESH_ROUTER_API_KEY", "") or None,
                   help="key the gateway presents to the router, when the router has keys "
                        "[$STAGEMESH_ROUTER_API_KEY]")
    p.add_argument("--max-body-bytes", type=at_least_one, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body (beyond: 413); default 4 MiB, the router's "
                        "gRPC request limit")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the router's)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="model directory whose tokenizer renders logprob tokens as text "
                        "(default: the model store's copy of the served model)")
    p.add_argument("--request-timeout", type=positive_seconds, default=None,
                   help="deadline in seconds for each router call (beyond: 504)")
    add_drain_timeout_arg(p, "open responses")
    add_tracing_arg(p, "the gateway's spans")
    p.add_argument("--router-connections", type=at_least_one, default=1, metavar="N",
                   help="TCP connections to the router, each request on the one with the "
                        "fewest calls in flight (ties in turn); set it to the router's "
                        "--api-processes, since the kernel spreads connections, not calls, "
                        "over its front processes (default: %(default)s; `stagemesh serve` "
                        "passes its --api-processes)")
    p.set_defaults(handler=_gateway)


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """The `stagemesh gateway` flags as a config; a bad value or an unreadable file (keys,
    TLS) exits with one line."""
    from gateway.config import GatewayConfig

    try:
        return GatewayConfig(
            router=args.router, host=args.host, port=args.port, api_keys=api_keys(args),
            router_api_key=args.router_api_key, router_tls=client_tls_of(args, "router"),
            max_body_bytes=args.max_body_bytes, served_model_name=args.served_model_name,
            tokenizer_dir=args.tokenizer, request_timeout_s=args.request_timeout,
            router_connections=args.router_connections,
            drain_timeout_s=args.drain_timeout,
            otlp_traces_endpoint=args.otlp_traces_endpoint)
    except (OSError, ValueError) as e:
        raise SystemExit(f"stagemesh gateway: {e}") from None


def _gateway(args: argparse.Namespace) -> int:
    from gateway.server import run_gateway

    return run_gateway(gateway_config(args), args.ready_file)
