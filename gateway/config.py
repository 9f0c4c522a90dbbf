"""The gateway process's configuration, composed once at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from foundation.tls import ClientTls

# The router refuses gRPC requests over 4 MiB (`RouterConfig.max_request_bytes`): a larger
# HTTP body could never be forwarded, so the gateway refuses it with 413 before parsing.
DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class GatewayConfig:
    """Attributes:
        router: host:port of the router's public gRPC API.
        host / port: the HTTP listener (port 0 = any free port).
        api_keys: accepted bearer keys; empty = no authentication.
        router_api_key: the key presented to the router (`authorization` metadata), or None.
        router_tls: TLS (mutual with a client certificate) to the router; None = plaintext.
        max_body_bytes: largest request body accepted (beyond: 413).
        served_model_name: the name clients use; None = the router's own name. When set,
            requests naming another model get 404 from the gateway itself.
        tokenizer_dir: HF-layout directory whose tokenizer.json renders token ids as text in
            `logprobs`; None = the model store's copy of the served model, if any.
        request_timeout_s: deadline for each router call (DEADLINE_EXCEEDED -> 504); None =
            no deadline.
        max_prompts: most prompts in one /v1/completions request (each is a router call).
        drain_timeout_s: on SIGTERM, how long open responses may take to finish.
        router_connections: clients to the router, each on a TCP connection of its own;
            each request's router calls go on one of them (`gateway/connections.py`). Set it
            to the router's `--api-processes`: the kernel spreads connections, not calls,
            over the router's front processes.
        otlp_traces_endpoint: where OpenTelemetry spans go (`foundation.tracing`); None =
            the standard environment's, else no tracing.
    """

    router: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: frozenset[str] = frozenset()
    router_api_key: str | None = None
    router_tls: ClientTls | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    served_model_name: str | None = None
    tokenizer_dir: Path | None = None
    request_timeout_s: float | None = None
    max_prompts: int = 64
    drain_timeout_s: float = 30.0
    router_connections: int = 1
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.router_connections < 1:
            raise ValueError(f"router_connections must be >= 1, got {self.router_connections}")
        if any(not k or k != k.strip() for k in self.api_keys):
            raise ValueError("API keys must be non-empty and carry no surrounding whitespace")
