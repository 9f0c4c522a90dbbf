"""`stagemesh stage`, `router` and `serve` (`gateway` is in `stagemesh.cli_gateway`):
argument parsing only, and the helpers the service commands share.

Each service reads its addresses from flags or, where noted, the environment, so the same
image runs anywhere (Kubernetes sets the environment).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from router.tool_calls.parsers import PARSER_CHOICES
from stagemesh.cli_credentials import (
    add_api_key_args,
    add_client_tls_args,
    add_server_tls_args,
    add_stage_token_arg,
    api_keys,
    client_tls_of,
    env_path,
    server_tls_of,
    stage_token_of,
)

if TYPE_CHECKING:
    from router.config import RouterConfig

SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_int(name: str) -> int | None:
    """An optional port from the environment (unset or empty: None)."""
    value = os.environ.get(name, "")
    return int(value) if value else None


def add_tracing_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help=f"send OpenTelemetry traces ({what}) to this OTLP/gRPC collector, "
                        "e.g. http://127.0.0.1:4317 (default: $OTEL_EXPORTER_OTLP_TRACES_"
                        "ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing)")


def _add_metrics_port_arg(p: argparse.ArgumentParser, env: str, what: str) -> None:
    p.add_argument("--metrics-port", type=int, default=env_int(env),
                   help=f"serve Prometheus metrics{what} at http://HOST:PORT/metrics (0: any "
                        f"free port; default: none) [${env}]")


def _layers(text: str) -> tuple[int, ...]:
    """A stage's or serve's explicit split."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"layers must be comma-separated counts, got {text!r}") from None


def _serve_layers(text: str) -> tuple[int, ...] | str:
    """serve's: an explicit split, or "auto"."""
    return "auto" if text == "auto" else _layers(text)


def at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_service_commands(commands: SubParsers) -> None:
    _add_stage(commands)
    _add_router(commands)
    _add_serve(commands)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=env("STAGEMESH_MODEL", "default"),
                   help="'default' (SmolLM2-135M-Instruct) or an HF-layout directory "
                        "[$STAGEMESH_MODEL]")


def _add_stage(commands: SubParsers) -> None:
    p = commands.add_parser("stage", help="run one pipeline stage (its TP ranks included)")
    _add_model_args(p)
    p.add_argument("--stage-index", type=int, default=int(env("STAGEMESH_STAGE_INDEX", "0")),
                   help="this stage's index, 0 first [$STAGEMESH_STAGE_INDEX]")
    p.add_argument("--num-stages", type=int, default=int(env("STAGEMESH_NUM_STAGES", "1")),
                   help="stages in the pipeline [$STAGEMESH_NUM_STAGES]")
    p.add_argument("--layers", type=_layers, default=None,
                   help="layer count per stage, e.g. 12,9,9 (default: even split)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks in this stage")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="fix the KV pool size")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV pool memory per rank")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="this stage's share of its GPU")
    _add_model_impl_arg(p)
    _add_stage_capacity_args(p)
    p.add_argument("--host", default=env("STAGEMESH_STAGE_HOST", "127.0.0.1"),
                   help="control listener address [$STAGEMESH_STAGE_HOST]")
    p.add_argument("--port", type=int, default=int(env("STAGEMESH_STAGE_PORT", "0")))
    p.add_argument("--dataplane-host", default=env("STAGEMESH_DATAPLANE_HOST", ""),
                   help="address the data-plane listener binds (default: the host the router "
                   "reaches this stage by) [$STAGEMESH_DATAPLANE_HOST]")
    p.add_argument("--dataplane-port", type=int,
                   default=int(env("STAGEMESH_DATAPLANE_PORT", "0")),
                   help="data-plane listener port (0: any free one) [$STAGEMESH_DATAPLANE_PORT]")
    p.add_argument("--dataplane-advertise", default=env("STAGEMESH_DATAPLANE_ADVERTISE", ""),
                   help="host the upstream stage dials (default: the bound host, or the "
                   "router's name for this stage when bound to a wildcard) "
                   "[$STAGEMESH_DATAPLANE_ADVERTISE]")
    p.add_argument("--step-timeout", type=float, default=60.0)
    add_tracing_arg(p, "the spans of traced requests' steps")
    _add_metrics_port_arg(p, "STAGEMESH_STAGE_METRICS_PORT", "")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never replay CUDA graphs for decode steps")
    _add_quantization_arg(p)
    _add_compression_arg(p)
    p.add_argument("--transport", default="auto", choices=("auto", "tcp", "cuda_ipc", "nccl"),
                   help="data-plane transports this stage offers for activations: auto (tcp, "
                        "and cuda_ipc and nccl on a CUDA device with cupy, and its NCCL, "
                        "installed), or only one; the router picks per hop among what both "
                        "ends offer")
    p.add_argument("--standby", action="store_true",
                   help="hold no layers until the router assigns this stage the place of one "
                        "that failed (the router's --standby-stages lists it); --stage-index "
                        "and --num-stages are then the assignment's; --tp 1")
    p.add_argument("--dataplane-tls-ca", type=Path,
                   default=env_path("STAGEMESH_DATAPLANE_TLS_CA"),
                   help="PEM CA that signed the other stages' certificates: turns TLS on for "
                        "this stage's TCP data-plane links (it presents --tls-cert/--tls-key "
                        "when it accepts a link, and checks the peer's certificate and the "
                        "name it dials against this CA when it connects); every stage of the "
                        "pipeline must set it [$STAGEMESH_DATAPLANE_TLS_CA]")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="write the bound address here once serving")
    add_stage_token_arg(p, "only a router that presents it may call this stage")
    add_server_tls_args(p)
    p.set_defaults(handler=_stage)


def _dataplane_tls(args: argparse.Namespace) -> tuple[str, str, str]:
    """The StageConfig fields of data-plane TLS (certificate, key, CA; "" each when off);
    exits with one line when the flags do not go together or a file cannot be read."""
    if args.dataplane_tls_ca is None:
        return "", "", ""
    if args.tls_cert is None or args.tls_key is None:
        raise SystemExit("stagemesh stage: --dataplane-tls-ca needs the stage's own "
                         "certificate: --tls-cert and --tls-key")
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                       ("--dataplane-tls-ca", args.dataplane_tls_ca)):
        if not path.is_file():
            raise SystemExit(f"stagemesh stage: {flag}: cannot read {path}")
    from stage_worker.dataplane.config import DataPlaneTls

    try:  # the stage loads them again where it links; a bad file stops it here
        DataPlaneTls.load(args.tls_cert, args.tls_key, args.dataplane_tls_ca)
    except ValueError as e:
        raise SystemExit(f"stagemesh stage: {e}") from None
    return str(args.tls_cert), str(args.tls_key), str(args.dataplane_tls_ca)


def _add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", default="none", choices=("none", "fp8"),
                   help="fp8: the decoder layers' projections stored as e4m3 with one scale "
                        "per output feature (half the weight memory and bytes per decode "
                        "step; FP8 kernels on CUDA devices of compute capability 8.9+, the "
                        "torch reference elsewhere; docs/BENCHMARKS.md states its accuracy)")


def _add_compression_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activation-compression", default="none",
                   choices=("none", "bf16", "fp16", "int8"),
                   help="form of the activations a stage sends downstream: as computed, cast "
                        "to 16 bits, or int8 with a scale per token (for links where "
                        "bandwidth is scarce; docs/BENCHMARKS.md gives each one's error)")


def _add_model_impl_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-impl", default="auto", choices=("auto", "llama", "null"),
                   help="model implementation: auto/llama (the model's weights), or null (no "
                        "model compute, no weights: control-plane benchmark)")


def _add_stage_capacity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="largest step (tokens) the stage sizes its activations for and accepts")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences one step may compute")


def _stage(args: argparse.Namespace) -> int:
    from foundation.modelstore import resolve_model
    from kernels.platform import DeviceUnavailableError, resolve_device
    from stage_worker.config import StageConfig
    from stage_worker.main import run_stage

    try:
        device = str(resolve_device(args.device))
    except DeviceUnavailableError as e:
        raise SystemExit(f"stagemesh stage: --device {e}") from None
    tls_cert, tls_key, tls_ca = _dataplane_tls(args)
    cfg = StageConfig(
        model_dir=resolve_model(args.model), stage_index=args.stage_index,
        num_stages=args.num_stages, layer_override=args.layers, tp_size=args.tp,
        device=device, dtype=args.dtype, block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_bytes=int(args.kv_cache_gb * 2**30) if args.kv_cache_gb else None,
        gpu_memory_utilization=args.gpu_memory_utilization, model_impl=args.model_impl,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        host=args.host, port=args.port,
        dataplane_host=args.dataplane_host, dataplane_port=args.dataplane_port,
        dataplane_advertise=args.dataplane_advertise, step_timeout_s=args.step_timeout,
        enforce_eager=args.enforce_eager, quantization=args.quantization,
        activation_compression=args.activation_compression,
        transport=args.transport, dataplane_tls_cert=tls_cert, dataplane_tls_key=tls_key,
        dataplane_tls_ca=tls_ca, standby=args.standby, metrics_port=args.metrics_port,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )
    return run_stage(cfg, args.ready_file, server_tls_of(args), stage_token_of(args))


def _add_router_args(p: argparse.ArgumentParser) -> None:
    add_api_key_args(p)
    p.add_argument("--model-name", default=None,
                   help="name clients use (default: the model directory's name)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument("--max-queued-requests", type=int, default=1024)
    p.add_argument("--max-queued-tokens", type=int, default=1 << 20)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--startup-budget", type=float, default=300.0)
    p.add_argument("--recovery-budget", type=float, default=60.0)
    p.add_argument("--step-timeout", type=float, default=30.0)
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed update (1 = every token)")
    p.add_argument("--no-run-ahead", action="store_true",
                   help="plan a sequence's next step only once its previous token reached the "
                        "router (default: run ahead; the stages feed the token forward)")
    p.add_argument("--run-ahead-depth", type=int, default=4,
                   help="with run-ahead, steps of one sequence planned at once (default 4; "
                        "2 is the least: one planned on another); deeper lets the router "
                        "send several steps' plans in one message, and a finish learned "
                        "late costs up to depth - 1 discarded tokens of that sequence")
    p.add_argument("--trace-step-interval", type=int, default=64, metavar="N",
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
    p.add_argument("--transport", default="auto", choices=("auto", "tcp", "cuda_ipc", "nccl"),
                   help="data-plane transport of each hop between stages: auto (cuda_ipc "
                        "between two stages on one host that both offer it, nccl between "
                        "two GPU stages on different hosts that both offer it, TCP elsewhere "
                        "and for a hop whose cuda_ipc or nccl link fails), tcp, cuda_ipc or "
                        "nccl (every hop; the pipeline does not come up while one cannot "
                        "have it). The "
                        "feedback link (last stage to first) is always TCP. `stagemesh serve` "
                        "passes it to its stages too, which then offer only that transport "
                        "(auto: what they can) (default: %(default)s)")
    p.add_argument("--tool-call-parser", default="auto", choices=PARSER_CHOICES,
                   help="how tool calls are found in chat outputs, as vLLM's flag: hermes "
                        "(<tool_call> JSON </tool_call>: Hermes, Qwen2.5), llama3_json "
                        "(Llama 3.1+ JSON calls), auto (from the chat template: <tool_call> "
                        "-> hermes, <|python_tag|> or ipython -> llama3_json, else none), "
                        "none (only tool_choice none is served) (default: %(default)s)")
    p.add_argument("--standby-grace", type=float, default=5.0, metavar="SECONDS",
                   help="how long a lost stage may take to come back before a standby stage "
                        "takes its place (default: %(default)s)")


def _add_router(commands: SubParsers) -> None:
    p = commands.add_parser("router", help="run the router (public gRPC API)")
    _add_model_args(p)
    p.add_argument("--stages", default=env("STAGEMESH_STAGES", ""),
                   help="comma-separated host:port of each stage, in order [$STAGEMESH_STAGES]")
    p.add_argument("--standby-stages", default=env("STAGEMESH_STANDBY_STAGES", ""),
                   help="comma-separated host:port of standby stages (`stagemesh stage "
                        "--standby`): one takes the place of a stage lost for "
                        "--standby-grace seconds [$STAGEMESH_STANDBY_STAGES]")
    p.add_argument("--host", default=env("STAGEMESH_ROUTER_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("STAGEMESH_ROUTER_PORT", "50051")))
    p.add_argument("--ready-file", default=None)
    _add_metrics_port_arg(p, "STAGEMESH_ROUTER_METRICS_PORT",
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
        step_timeout_s=args.step_timeout, stream_interval=max(1, args.stream_interval),
        engine_core=args.engine_core, run_ahead=not args.no_run_ahead,
        run_ahead_depth=args.run_ahead_depth, trace_step_interval=args.trace_step_interval,
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
    _add_model_args(p)
    p.add_argument("--stages", type=int, default=1, help="pipeline stages")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    p.add_argument("--layers", type=_serve_layers, default=None, metavar="N,N,...|auto",
                   help="layers per stage, pipeline order, e.g. 18,12: an uneven split (a "
                        "stage on a device with more memory takes more); they must sum to "
                        "the model's layers. auto: split by each stage's share of its "
                        "device's free memory, for the most KV room (the even split on CPU) "
                        "(default: as even as possible)")
    p.add_argument("--standby", type=int, default=0, metavar="N",
                   help="standby stage processes to keep beside the pipeline: when a stage "
                        "does not come back within --standby-grace, one takes its place "
                        "(loads its layers) instead of waiting for the restart; --tp 1 only "
                        "(default: %(default)s)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--host", default="127.0.0.1", help="router address")
    p.add_argument("--port", type=int, default=50051, help="router port")
    add_tracing_arg(p, "the gateway's, the router's and the stages' spans")
    p.add_argument("--no-metrics", action="store_true",
                   help="no Prometheus endpoints on the router and the stages (default: each "
                        "serves one on a free port, printed when the mesh is ready; the "
                        "gateway's is at its HTTP port's /metrics)")
    p.add_argument("--gateway-port", type=int, default=8000,
                   help="HTTP gateway port (0 = no gateway)")
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-gb", type=float, default=None)
    _add_model_impl_arg(p)
    p.add_argument("--enforce-eager", action="store_true",
                   help="stages never replay CUDA graphs for decode steps")
    _add_quantization_arg(p)
    _add_compression_arg(p)
    _add_router_args(p)
    p.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from stagemesh.launcher import launch

    return launch(args, api_keys(args))
