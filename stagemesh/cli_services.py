"""`stagemesh router` and `serve`, and `add_service_commands`, which registers them after
`stage` (`stagemesh.cli_stage`; `gateway` is in `stagemesh.cli_gateway`): argument parsing
only. The flags the service commands share are in `stagemesh.cli_flags`.

Each service reads its addresses from flags or, where noted, the environment, so the same
image runs anywhere (Kubernetes sets the environment).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from router.tool_calls.parsers import PARSER_CHOICES
from stagemesh import cpu_policy
from stagemesh.cli_credentials import (
    add_api_key_args,
    add_client_tls_args,
    add_server_tls_args,
    add_stage_token_arg,
    api_keys,
    client_tls_of,
    server_tls_of,
    stage_token_of,
)
from stagemesh.cli_flags import (
    SubParsers,
    add_compression_arg,
    add_drain_timeout_arg,
    add_kv_cache_dtype_arg,
    add_metrics_port_arg,
    add_model_args,
    add_model_impl_arg,
    add_quantization_arg,
    add_tracing_arg,
    at_least_one,
    env,
    layer_split,
    milliseconds,
    port,
    positive_seconds,
    seconds,
    whole,
)
from stagemesh.cli_stage import add_stage

if TYPE_CHECKING:
    from router.config import RouterConfig


def _serve_layers(text: str) -> tuple[int, ...] | str:
    """serve's: an explicit split, or "auto"."""
    return "auto" if text == "auto" else layer_split(text)


def add_service_commands(commands: SubParsers) -> None:
    add_stage(commands)
    _add_router(commands)
    _add_serve(commands)


def _add_router_args(p: argparse.ArgumentParser) -> None:
    add_api_key_args(p)
    p.add_argument("--model-name", default=None,
                   help="name clients use (default: the model directory's name)")
    p.add_argument("--max-num-seqs", type=at_least_one, default=256)
    p.add_argument("--max-num-batched-tokens", type=at_least_one, default=2048)
    p.add_argument("--max-model-len", type=whole(0), default=0,
                   help="longest prompt + output in tokens (default 0: the model's context)")
    p.add_argument("--max-queued-requests", type=at_least_one, default=1024)
    p.add_argument("--max-queued-tokens", type=at_least_one, default=1 << 20)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--startup-budget", type=seconds, default=300.0)
    p.add_argument("--recovery-budget", type=seconds, default=60.0)
    p.add_argument("--step-timeout", type=positive_seconds, default=30.0)
    add_drain_timeout_arg(p, "requests in flight",
                          "; new ones are refused at once and those still running then end "
                          "with UNAVAILABLE. Keep the pod's terminationGracePeriodSeconds "
                          "above it; `stagemesh serve` gives its gateway the same")
    p.add_argument("--stream-interval", type=at_least_one, default=1,
                   help="tokens per streamed update (1 = every token)")
    p.add_argument("--no-run-ahead", action="store_true",
                   help="plan a sequence's next step only once its previous token reached the "
                        "router (default: run ahead; the stages feed the token forward)")
    p.add_argument("--run-ahead-depth", type=whole(2), default=4,
                   help="with run-ahead, steps of one sequence planned at once (default 4; "
                        "2 is the least: one planned on another); deeper lets the router "
                        "send several steps' plans in one message, and a finish learned "
                        "late costs up to depth - 1 discarded tokens of that sequence")
    p.add_argument("--run-ahead-budget-ms", type=milliseconds, default=20.0, metavar="MS",
                   help="with run-ahead, while the pipeline's steps are short, plan deeper "
                        "than --run-ahead-depth (up to twice it), as deep as the steps "
                        "planned ahead run in this many milliseconds: a request that "
                        "arrives during steady decode waits behind them (default 20; 0: "
                        "always --run-ahead-depth)")
    p.add_argument("--micro-batches", type=whole(0), default=0, metavar="N",
                   help="steps kept in flight through the pipeline over disjoint sequences, "
                        "at most one per stage (default 0: one per device the stages compute "
                        "on; stages that share one GPU, or one host's CPU cores, take turns "
                        "on it and get one between them)")
    p.add_argument("--trace-step-interval", type=whole(0), default=64, metavar="N",
                   help="with tracing on, every N-th step that computes a traced request's "
                        "sequence is recorded by each stage as a span of that request's trace "
                        "(besides the step of its first prefill chunk, always); 0 = that "
                        "step only (default: %(default)s)")
    p.add_argument("--engine-core", choices=("process", "task"), default="process",
                   help="run the engine core (scheduler, KV, pipeline driver) in its own "
                        "process (default), or as a task of the router's front (debugging)")
    p.add_argument("--no-audit-log", action="store_true",
                   help="no audit line per request (default: one JSON line per Generate call "
                        "on stderr: request id, API key id, client, model, token counts, "
                        "finish reasons, status; never the key)")
    p.add_argument("--audit-log-content", action="store_true",
                   help="put the prompt and output text in the audit lines (off by default)")
    p.add_argument("--api-processes", type=at_least_one, default=1, metavar="N",
                   help="processes serving the public gRPC API on the router's host:port, "
                        "each a front of the one engine core (validation, tokenization, "
                        "detokenization, stop strings, streaming): the router's own and N-1 "
                        "more, sharing the port (SO_REUSEPORT) so the kernel spreads client "
                        "connections across them; a connection stays on one process. Raise "
                        "it when one process's per-token work limits throughput, e.g. "
                        "hundreds of concurrent streams (default: %(default)s)")
    p.add_argument("--transport", default="auto",
                   choices=("auto", "tcp", "unix", "cuda_ipc", "nccl"),
                   help="data-plane transport of each hop between stages: auto (cuda_ipc "
                        "between two stages on one host that both offer it, else a "
                        "Unix-domain socket (unix) between two stages of one host, nccl "
                        "between two GPU stages on different hosts that both offer it, TCP "
                        "elsewhere and for a hop whose cuda_ipc, unix or nccl link fails), "
                        "tcp, unix, cuda_ipc or nccl (every hop; the pipeline does not come "
                        "up while one cannot have it). The feedback link (last stage to "
                        "first) is unix where both of its stages offer it, unless tcp is "
                        "asked for; else TCP. `stagemesh serve` passes it to its stages "
                        "too, which then offer only that transport (auto: what they can) "
                        "(default: %(default)s)")
    p.add_argument("--tool-call-parser", default="auto", choices=PARSER_CHOICES,
                   help="how tool calls are found in chat outputs, as vLLM's flag: hermes "
                        "(<tool_call> JSON </tool_call>: Hermes, Qwen2.5), llama3_json "
                        "(Llama 3.1+ JSON calls), auto (from the chat template: <tool_call> "
                        "-> hermes, <|python_tag|> or ipython -> llama3_json, else none), "
                        "none (only tool_choice none is served) (default: %(default)s)")
    p.add_argument("--standby-grace", type=seconds, default=5.0, metavar="SECONDS",
                   help="how long a lost stage may take to come back before a standby stage "
                        "takes its place (default: %(default)s)")


def _add_router(commands: SubParsers) -> None:
    p = commands.add_parser("router", help="run the router (public gRPC API)")
    add_model_args(p)
    p.add_argument("--stages", default=env("STAGEMESH_STAGES", ""),
                   help="comma-separated host:port of each stage, in order [$STAGEMESH_STAGES]")
    p.add_argument("--standby-stages", default=env("STAGEMESH_STANDBY_STAGES", ""),
                   help="comma-separated host:port of standby stages (`stagemesh stage "
                        "--standby`): one takes the place of a stage lost for "
                        "--standby-grace seconds [$STAGEMESH_STANDBY_STAGES]")
    p.add_argument("--host", default=env("STAGEMESH_ROUTER_HOST", "127.0.0.1"))
    p.add_argument("--port", type=port, default=int(env("STAGEMESH_ROUTER_PORT", "50051")))
    p.add_argument("--ready-file", default=None)
    add_metrics_port_arg(p, "STAGEMESH_ROUTER_METRICS_PORT",
                          " (every front's and the engine core's, summed)")
    add_tracing_arg(p, "the router's spans")
    _add_router_args(p)
    add_server_tls_args(p)
    add_stage_token_arg(p, "presented on every call to the stages")
    add_client_tls_args(p, "stage")
    p.set_defaults(handler=_router)


def router_config(args: argparse.Namespace, stages: tuple[str, ...]) -> RouterConfig:
    from foundation.modelstore import resolve_model
    from router.config import RouterConfig

    model_dir = resolve_model(args.model)
    name = args.model_name or model_dir.name
    return RouterConfig(
        model_dir=model_dir, model_name=name, stage_addresses=stages, host=args.host,
        port=args.port, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        startup_budget_s=args.startup_budget, recovery_budget_s=args.recovery_budget,
        step_timeout_s=args.step_timeout, drain_timeout_s=args.drain_timeout,
        stream_interval=max(1, args.stream_interval),
        engine_core=args.engine_core, run_ahead=not args.no_run_ahead,
        run_ahead_depth=args.run_ahead_depth, run_ahead_budget_ms=args.run_ahead_budget_ms,
        micro_batches=args.micro_batches,
        trace_step_interval=args.trace_step_interval,
        api_processes=args.api_processes,
        api_keys=api_keys(args),
        audit_log=not args.no_audit_log, audit_log_content=args.audit_log_content,
        transport=args.transport,
        standby_stages=tuple(s.strip() for s in getattr(args, "standby_stages", "").split(",")
                             if s.strip()),
        standby_grace_s=args.standby_grace,
        tool_call_parser=args.tool_call_parser,
        metrics_port=getattr(args, "metrics_port", None),
        otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", None),
    )


def _router(args: argparse.Namespace) -> int:
    from router.main import run_router

    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    if not stages:
        raise SystemExit("stagemesh router: --stages (or $STAGEMESH_STAGES) is required")
    from dataclasses import replace

    cfg = replace(router_config(args, stages),
                  tls=server_tls_of(args), stage_tls=client_tls_of(args, "stage"),
                  stage_token=stage_token_of(args))
    return run_router(cfg, args.ready_file)


def _add_serve(commands: SubParsers) -> None:
    p = commands.add_parser(
        "serve", help="bring up a whole pipeline on this machine: stages, router, gateway")
    add_model_args(p)
    p.add_argument("--stages", type=at_least_one, default=1, help="pipeline stages")
    p.add_argument("--tp", type=at_least_one, default=1, help="tensor-parallel ranks per stage")
    p.add_argument("--layers", type=_serve_layers, default=None, metavar="N,N,...|auto",
                   help="layers per stage, pipeline order, e.g. 18,12: an uneven split (a "
                        "stage on a device with more memory takes more); they must sum to "
                        "the model's layers. auto: split by each stage's share of its "
                        "device's free memory, for the most KV room (the even split on CPU) "
                        "(default: as even as possible)")
    p.add_argument("--standby", type=whole(0), default=0, metavar="N",
                   help="standby stage processes to keep beside the pipeline: when a stage "
                        "does not come back within --standby-grace, one takes its place "
                        "(loads its layers) instead of waiting for the restart; --tp 1 only "
                        "(default: %(default)s)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--host", default="127.0.0.1", help="router address")
    p.add_argument("--port", type=port, default=50051, help="router port")
    add_tracing_arg(p, "the gateway's, the router's and the stages' spans")
    p.add_argument("--no-metrics", action="store_true",
                   help="no Prometheus endpoints on the router and the stages (default: each "
                        "serves one on a free port, printed when the mesh is ready; the "
                        "gateway's is at its HTTP port's /metrics)")
    p.add_argument("--gateway-port", type=port, default=8000,
                   help="HTTP gateway port (0 = no gateway)")
    p.add_argument("--num-blocks", type=at_least_one, default=None)
    p.add_argument("--kv-cache-gb", type=float, default=None)
    add_model_impl_arg(p)
    p.add_argument("--enforce-eager", action="store_true",
                   help="stages never replay CUDA graphs for decode steps")
    add_quantization_arg(p)
    add_kv_cache_dtype_arg(p)
    add_compression_arg(p)
    p.add_argument("--cpu-policy", default="auto", choices=cpu_policy.CHOICES,
                   help="Linux scheduling policy of every process serve starts: batch "
                        "(SCHED_BATCH: a woken thread waits for the running one to block "
                        "instead of preempting it; fewer switches when the mesh's processes "
                        "share few cores), normal (the kernel's default), or auto: batch "
                        "when the processes that work on every step (stages x TP ranks, the "
                        "engine core, the API processes) outnumber this machine's usable "
                        "cores (default: %(default)s)")
    _add_router_args(p)
    p.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    if args.cpu_policy == "batch" and not cpu_policy.supported():
        raise SystemExit("stagemesh serve: --cpu-policy batch needs Linux's SCHED_BATCH; "
                         "this platform has none (use --cpu-policy normal or auto)")
    from stagemesh.launcher import launch

    return launch(args, api_keys(args))
