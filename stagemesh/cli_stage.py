"""`stagemesh stage`: one pipeline stage's flags and the `StageConfig` they make.

This module owns the `stage` command's command line: its flags (addresses from flags or the
environment, so the same image runs anywhere), the check that data-plane TLS flags go together
and their files load, and the handler that builds the stage's config and runs it. Flags `serve`
shares with it are in `stagemesh.cli_flags`; `serve` passes its own on to its stages
(`stagemesh.launcher`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stagemesh.cli_credentials import (
    add_server_tls_args,
    add_stage_token_arg,
    env_path,
    server_tls_of,
    stage_token_of,
)
from stagemesh.cli_flags import (
    SubParsers,
    add_compression_arg,
    add_kv_cache_dtype_arg,
    add_metrics_port_arg,
    add_model_args,
    add_model_impl_arg,
    add_quantization_arg,
    add_tracing_arg,
    at_least_one,
    env,
    layer_split,
    port,
    positive_seconds,
    whole,
)


def add_stage(commands: SubParsers) -> None:
    p = commands.add_parser("stage", help="run one pipeline stage (its TP ranks included)")
    add_model_args(p)
    p.add_argument("--stage-index", type=whole(0), default=int(env("STAGEMESH_STAGE_INDEX", "0")),
                   help="this stage's index, 0 first [$STAGEMESH_STAGE_INDEX]")
    p.add_argument("--num-stages", type=at_least_one, default=int(env("STAGEMESH_NUM_STAGES", "1")),
                   help="stages in the pipeline [$STAGEMESH_NUM_STAGES]")
    p.add_argument("--layers", type=layer_split, default=None,
                   help="layer count per stage, e.g. 12,9,9 (default: even split)")
    p.add_argument("--tp", type=at_least_one, default=1, help="tensor-parallel ranks in this stage")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--block-size", type=at_least_one, default=16)
    p.add_argument("--num-blocks", type=at_least_one, default=None, help="fix the KV pool size")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV pool memory per rank")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="this stage's share of its GPU")
    add_model_impl_arg(p)
    _add_stage_capacity_args(p)
    p.add_argument("--host", default=env("STAGEMESH_STAGE_HOST", "127.0.0.1"),
                   help="control listener address [$STAGEMESH_STAGE_HOST]")
    p.add_argument("--port", type=port, default=int(env("STAGEMESH_STAGE_PORT", "0")))
    p.add_argument("--dataplane-host", default=env("STAGEMESH_DATAPLANE_HOST", ""),
                   help="address the data-plane listener binds (default: the host the router "
                   "reaches this stage by) [$STAGEMESH_DATAPLANE_HOST]")
    p.add_argument("--dataplane-port", type=port,
                   default=int(env("STAGEMESH_DATAPLANE_PORT", "0")),
                   help="data-plane listener port (0: any free one) [$STAGEMESH_DATAPLANE_PORT]")
    p.add_argument("--dataplane-advertise", default=env("STAGEMESH_DATAPLANE_ADVERTISE", ""),
                   help="host the upstream stage dials (default: the bound host, or the "
                   "router's name for this stage when bound to a wildcard) "
                   "[$STAGEMESH_DATAPLANE_ADVERTISE]")
    p.add_argument("--step-timeout", type=positive_seconds, default=60.0)
    add_tracing_arg(p, "the spans of traced requests' steps")
    add_metrics_port_arg(p, "STAGEMESH_STAGE_METRICS_PORT", "")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never replay CUDA graphs for decode steps")
    add_quantization_arg(p)
    add_kv_cache_dtype_arg(p)
    add_compression_arg(p)
    p.add_argument("--transport", default="auto",
                   choices=("auto", "tcp", "unix", "cuda_ipc", "nccl"),
                   help="data-plane transports this stage offers for activations: auto (tcp, "
                        "unix on Linux, and cuda_ipc and nccl on a CUDA device with cupy, "
                        "and its NCCL, installed), or only one; the router picks per hop "
                        "among what both ends offer")
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

def _add_stage_capacity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-batched-tokens", type=at_least_one, default=2048,
                   help="largest step (tokens) the stage sizes its activations for and accepts")
    p.add_argument("--max-num-seqs", type=at_least_one, default=256,
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
        kv_cache_dtype=args.kv_cache_dtype,
        activation_compression=args.activation_compression,
        transport=args.transport, dataplane_tls_cert=tls_cert, dataplane_tls_key=tls_key,
        dataplane_tls_ca=tls_ca, standby=args.standby, metrics_port=args.metrics_port,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )
    return run_stage(cfg, args.ready_file, server_tls_of(args), stage_token_of(args))
