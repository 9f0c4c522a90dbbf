"""The router process's configuration, composed once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from foundation.tls import ClientTls, ServerTls
from router.pipeline.transports import TRANSPORT_CHOICES
from router.tool_calls.parsers import PARSER_CHOICES


@dataclass(frozen=True)
class RouterConfig:
    """Attributes:
        model_dir: HF-layout model directory (the router reads config and tokenizer only).
        model_name: the name clients use in `model` fields.
        stage_addresses: host:port of each stage's control service, in pipeline order.
        host / port: the public gRPC listener.
        max_model_len: context limit; 0 = the model's, capped by what the KV pool holds.
        max_num_seqs / max_num_batched_tokens: per-step limits of the scheduler.
        max_queued_requests / max_queued_tokens: admission limits (beyond: 429).
        startup_budget_s: how long the stages may take to come up.
        recovery_budget_s: how long requests wait for a failed stage before UNAVAILABLE.
        step_timeout_s: a step without a result after this long marks the pipeline down.
        drain_timeout_s: on SIGTERM, how long in-flight requests may take to finish.
        max_request_bytes: largest gRPC request accepted (beyond: RESOURCE_EXHAUSTED).
        stream_interval: tokens per streamed update (1 = every token).
        api_keys: keys a caller of the public API must present (`authorization: Bearer`
            metadata); empty = no authentication. Health and reflection stay open.
        tls: the public listener's TLS (mutual with a client CA); None = plaintext.
        stage_tls: how the router reaches the stages' control APIs over TLS; None = plaintext.
        engine_core: "process" runs the engine core (scheduler, KV accounting, pipeline
            driver) in its own process, so the front's per-token work never delays a step;
            "task" runs it on the front's event loop (tests, debugging).
        run_ahead: plan a sequence's next step before its token came back to the router
            (the stages feed it to the first stage over the data plane); the output is the
            same either way. Off: every step waits for the previous one's tokens.
        stage_token: the secret this router presents on every call to its stages (metadata
            `authorization: Bearer`), which they require when they were given one: a stage
            serves only its paired router. Empty: none.
        run_ahead_depth: with run_ahead, steps of one sequence outstanding at once (>= 2);
            up to micro_batches * depth steps are outstanding, and the core sends the plans
            it has ready together in one message per stage.
        run_ahead_budget_ms: with run_ahead, while the pipeline's steps are short the core
            plans deeper than run_ahead_depth (up to twice it), as deep as the steps planned
            ahead run in this many milliseconds: a request that arrives during steady decode
            waits behind them. 0 = always run_ahead_depth (`router.core.pace`).
        micro_batches: steps kept in flight through the pipeline, over disjoint sets of
            sequences (pipeline micro-batches), at most one per stage; 0 = one per device
            the stages compute on: one per stage, but stages that share a GPU, or one host's
            CPU cores, take turns on it, so they get one between them (two micro-batches
            there would read the weights twice per token for no overlap).
        api_processes: processes serving the public API on host:port, each a front of the
            one engine core: the router's own and api_processes - 1 front processes
            (`router.front_process`), all bound with SO_REUSEPORT so the kernel spreads
            client connections across them. More than 1 when one process's per-token work
            (detokenizing, stop strings, one gRPC message per token per stream) limits
            throughput.
        audit_log: one JSON line per Generate call on stderr (`router.audit`).
        otlp_traces_endpoint: where OpenTelemetry spans go (`foundation.tracing`); None =
            the standard environment's, else no tracing.
        trace_step_interval: with tracing, every such step (by step id) that computes a
            traced request's sequence is a span on each stage too (`router.core.request_trace`);
            0 = only the step of each traced request's first prefill chunk.
        metrics_port: serve Prometheus metrics at http://host:port/metrics (0 picks one):
            every front's and the engine core's, summed (`router.metrics`); None = none.
        audit_log_content: put the prompt and output text in those lines (the users' data:
            off unless asked for).
        transport: the data-plane transport of each hop between stages: "auto" (CUDA IPC
            between two stages on one host that both offer it, else a Unix-domain socket
            between two stages of one host, NCCL between GPU stages on different hosts that
            both offer it, falling back to TCP for a hop where that link fails; TCP
            elsewhere), "tcp", "unix", "cuda_ipc" or "nccl" (every hop; the pipeline does
            not come up while a hop cannot have it). The feedback link (last stage -> first
            stage) is a Unix-domain socket inside one host unless "tcp" is asked for, else
            TCP (`choose_feedback_transport`).
        standby_stages: host:port of standby stages (`stagemesh stage --standby`), used in
            order: a stage that does not answer for `standby_grace_s` while the pipeline
            tries to come back is replaced by one (it loads that stage's layers), so a lost
            node does not wait for its restart.
        standby_grace_s: how long a lost stage may take to come back before a standby
            takes its place.
        tool_call_parser: how tool calls are found in chat outputs (vLLM's
            --tool-call-parser): "hermes", "llama3_json", "auto" (picked from the chat
            template's text: `<tool_call>` -> hermes, `<|python_tag|>` or `ipython` ->
            llama3_json, else none) or "none" (only tool_choice none is served).
    """

    model_dir: Path
    model_name: str
    stage_addresses: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 50051
    max_model_len: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    enable_prefix_caching: bool = True
    startup_budget_s: float = 300.0
    recovery_budget_s: float = 60.0
    step_timeout_s: float = 30.0
    drain_timeout_s: float = 30.0
    max_request_bytes: int = 4 << 20
    stream_interval: int = 1
    api_keys: frozenset[str] = frozenset()
    tls: ServerTls | None = None
    stage_tls: ClientTls | None = None
    engine_core: str = "process"
    run_ahead: bool = True
    run_ahead_depth: int = 4
    run_ahead_budget_ms: float = 20.0
    micro_batches: int = 0
    stage_token: str = field(default="", repr=False)
    api_processes: int = 1
    audit_log: bool = True
    audit_log_content: bool = False
    transport: str = "auto"
    standby_stages: tuple[str, ...] = ()
    standby_grace_s: float = 5.0
    metrics_port: int | None = None
    otlp_traces_endpoint: str | None = None
    trace_step_interval: int = 64
    tool_call_parser: str = "auto"

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.engine_core not in ("process", "task"):
            raise ValueError(f"engine_core must be 'process' or 'task', got {self.engine_core!r}")
        if self.api_processes < 1:
            raise ValueError(f"api_processes must be >= 1, got {self.api_processes}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.trace_step_interval < 0:
            raise ValueError(f"trace_step_interval must be >= 0, got {self.trace_step_interval}")
        if self.run_ahead_depth < 2:
            raise ValueError(f"run_ahead_depth must be >= 2 (one step planned on another), "
                             f"got {self.run_ahead_depth}")
        if not self.run_ahead_budget_ms >= 0:
            raise ValueError(f"run_ahead_budget_ms must be >= 0, got {self.run_ahead_budget_ms}")
        if self.micro_batches < 0:
            raise ValueError(f"micro_batches must be >= 0 (0 = one per device), got "
                             f"{self.micro_batches}")
        if self.tool_call_parser not in PARSER_CHOICES:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSER_CHOICES)}, "
                             f"got {self.tool_call_parser!r}")
        if self.transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORT_CHOICES)}, "
                             f"got {self.transport!r}")
