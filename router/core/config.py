"""The engine core's configuration: a subset of the router's, passed to the core process as
JSON on its stdin (no pickle)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from foundation.tls import ClientTls


@dataclass(frozen=True)
class CoreConfig:
    """Attributes:
        model_dir: the model directory (the core reads its config.json only).
        stage_addresses: host:port of each stage's control service, in pipeline order.
        stage_tls: how the core reaches the stages over TLS; None = plaintext.
        input_address: the Unix-domain socket path the core listens on for its fronts'
            streams (`router.core.channel`).
        max_model_len / max_num_seqs / max_num_batched_tokens / max_queued_requests /
            max_queued_tokens / enable_prefix_caching: as `RouterConfig`.
        startup_budget_s / recovery_budget_s / step_timeout_s: as `RouterConfig`.
        run_ahead: plan a sequence's next step before its token came back (the stages feed
            the token to the first stage over the data plane).
        run_ahead_depth / run_ahead_budget_ms: as `RouterConfig` (`RunAheadPace`).
        micro_batches: as `RouterConfig`.
        stage_token: as `RouterConfig`.
        transport: the data-plane transport asked for, as `RouterConfig` ("auto", "tcp",
            "cuda_ipc", "nccl"); the pipeline driver picks each hop's (`Pipeline.hop_transports`).
        standby_stages / standby_grace_s: as `RouterConfig`.
        metrics_dir: the router's multi-process metrics directory ("" = no metrics).
        otlp_traces_endpoint / trace_step_interval: as `RouterConfig` (the core records a
            span per traced request and names the steps the stages trace).
    """

    model_dir: str
    stage_addresses: tuple[str, ...]
    input_address: str
    stage_tls: ClientTls | None = None
    max_model_len: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    enable_prefix_caching: bool = True
    startup_budget_s: float = 300.0
    recovery_budget_s: float = 60.0
    step_timeout_s: float = 30.0
    run_ahead: bool = True
    run_ahead_depth: int = 4
    run_ahead_budget_ms: float = 20.0
    micro_batches: int = 0
    stage_token: str = field(default="", repr=False)
    transport: str = "auto"
    standby_stages: tuple[str, ...] = ()
    standby_grace_s: float = 5.0
    metrics_dir: str = ""
    otlp_traces_endpoint: str | None = None
    trace_step_interval: int = 64

    @property
    def max_run_ahead_depth(self) -> int:
        """The deepest the core runs ahead (`RunAheadPace.most`)."""
        return self.run_ahead_depth * (2 if self.run_ahead_budget_ms > 0 else 1)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> CoreConfig:
        return msgspec.json.decode(text, type=cls)
