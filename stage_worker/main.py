"""A stage process: spawn the TP ranks, build the stage, serve StageService until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from foundation.api_keys import ApiKeys
from foundation.grpc_auth import BearerInterceptor
from foundation.metrics import serve_metrics
from foundation.ports import free_port
from foundation.tls import ListenError, ServerTls, add_port
from foundation.tracing import setup_tracing
from kernels.platform import distributed_backend
from protos.stagemesh.stage.v1 import stage_pb2, stage_pb2_grpc
from stage_worker.build import build_stage_rank, rank_device
from stage_worker.config import StageConfig
from stage_worker.dataplane import DataPlaneConfig
from stage_worker.dataplane.compression import Compression
from stage_worker.dataplane.config import DataPlaneTls
from stage_worker.leader import StageLeader
from stage_worker.links import DataPlaneAddress
from stage_worker.metrics import StageMetrics
from stage_worker.parallel import TPGroup, init_tp_group
from stage_worker.service import StageIdentity, StageServicer
from stage_worker.standby import StandbyServicer
from stage_worker.tp_liveness import FD_ENV, RankBeats

log = logging.getLogger("stagemesh.stage")

# Activations never travel over gRPC, but a plan for a long prompt carries its token ids.
MAX_MESSAGE_BYTES = 64 << 20
PAIRED_PREFIX = "/stagemesh.stage.v1.StageService/"
NOT_PAIRED = ("this stage serves only its paired router: the call lacks the pipeline's stage "
              "token (metadata 'authorization: Bearer <token>'; the router's "
              "--stage-token-file or $STAGEMESH_STAGE_TOKEN)")


def spawn_tp_ranks(cfg: StageConfig, init_url: str
                   ) -> tuple[list[subprocess.Popen[bytes]], RankBeats]:
    """Start TP ranks 1..T-1 as real processes (no pickle: the config travels as JSON), each
    beating on a pipe of its own to this leader (`tp_liveness`)."""
    blob = cfg.to_json()
    ranks, beats = [], {}
    for r in range(1, cfg.tp_size):
        read_fd, write_fd = os.pipe()
        ranks.append(subprocess.Popen(
            [sys.executable, "-m", "stage_worker.tp_rank", str(r), init_url, blob],
            pass_fds=(write_fd,), env={**os.environ, FD_ENV: str(write_fd)}))
        os.close(write_fd)
        beats[ranks[-1].pid] = read_fd
    return ranks, RankBeats(beats)


def health_servicer() -> health.HealthServicer:
    servicer = health.HealthServicer()
    for name in ("", "liveness", "readiness"):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def stage_servicer(cfg: StageConfig, tp: TPGroup) -> StageServicer:
    """TP rank 0's stage behind its gRPC servicer (the other ranks must be joining `tp`)."""
    rank = build_stage_rank(cfg, tp)
    tls = DataPlaneTls.load(Path(cfg.dataplane_tls_cert), Path(cfg.dataplane_tls_key),
                            Path(cfg.dataplane_tls_ca)) if cfg.dataplane_tls_ca else None
    if tls is not None:
        log.info("data plane: TLS on every TCP link (certificate %s, peers checked against %s)",
                 cfg.dataplane_tls_cert, cfg.dataplane_tls_ca)
    leader = StageLeader(rank, cfg.step_timeout_s, DataPlaneAddress(
        cfg.dataplane_host, cfg.dataplane_port, cfg.dataplane_advertise),
        Compression(cfg.activation_compression), cfg.transport, DataPlaneConfig(tls=tls))
    servicer = StageServicer(leader, StageIdentity.of(cfg, rank))
    if cfg.metrics_port is not None:
        serve_stage_metrics(cfg, servicer)
    return servicer


def serve_stage_metrics(cfg: StageConfig, servicer: StageServicer) -> None:
    """Record the stage's metrics and serve them on cfg.metrics_port (a daemon thread for
    the life of the process). Raises ListenError if it cannot bind."""
    from prometheus_client import CollectorRegistry

    leader, identity = servicer.leader, servicer.identity
    held = leader.rank.held
    registry = CollectorRegistry()
    leader.metrics = StageMetrics(
        registry, leader.window, layers=(identity.layer_start, identity.layer_end),
        device=str(leader.rank.shape.device), tp_size=cfg.tp_size,
        kv_blocks_used=lambda: held.kv_blocks_used,
        kv_blocks_total=lambda: identity.num_kv_blocks, sequences=lambda: len(held.seqs))
    try:
        server = serve_metrics(registry, cfg.metrics_port or 0, cfg.host)
    except OSError as e:
        raise ListenError(f"--metrics-port: cannot listen on {cfg.host}:{cfg.metrics_port}: "
                          f"{e}") from None
    log.info("metrics on http://%s:%d/metrics", cfg.host, server.port)


def _control_server(servicer: StageServicer | StandbyServicer, stage_token: str
                    ) -> tuple[grpc.aio.Server, health.HealthServicer]:
    """The StageService with health and reflection, not bound yet, and its health servicer.
    No SO_REUSEPORT (gRPC's default on Linux): a port another server holds, a router's
    fronts or another stage, is refused at bind, never shared with it."""
    interceptors = [BearerInterceptor(ApiKeys([stage_token]), PAIRED_PREFIX, NOT_PAIRED)
                    ] if stage_token else []
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0)])
    stage_pb2_grpc.add_StageServiceServicer_to_server(servicer, server)
    health_srv = health_servicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_srv, server)
    reflection.enable_server_reflection(
        (stage_pb2.DESCRIPTOR.services_by_name["StageService"].full_name,
         reflection.SERVICE_NAME, health.SERVICE_NAME), server)
    return server, health_srv


async def serve_stage(cfg: StageConfig, ready_file: Path | None = None,
                      tls: ServerTls | None = None, stage_token: str = "") -> int:
    """`tls`: serve the control API over TLS (mutual with a client CA); None = plaintext.
    `stage_token`: the pairing secret a caller of the StageService must present (see
    `foundation.grpc_auth`); "" = any caller (that TLS lets through)."""
    servicer: StageServicer | StandbyServicer
    ranks: list[subprocess.Popen[bytes]] = []
    beats = RankBeats({})
    try:  # a taken port (the control API's or the metrics'): no TP rank is left behind
        if cfg.standby:
            servicer = StandbyServicer(cfg,
                                       lambda assigned: stage_servicer(assigned, TPGroup()))
        else:
            init_url = f"tcp://127.0.0.1:{cfg.tp_init_port or free_port()}"
            ranks, beats = spawn_tp_ranks(cfg, init_url)
            tp = init_tp_group(0, cfg.tp_size, init_url,
                               distributed_backend(rank_device(cfg, 0)))
            servicer = stage_servicer(cfg, tp)
        server, health_srv = _control_server(servicer, stage_token)
        port = add_port(server, cfg.host, cfg.port, tls)
    except ListenError:
        _stop_ranks(ranks)
        raise
    await server.start()
    address = f"{cfg.host}:{port}"
    if isinstance(servicer, StandbyServicer):
        log.info("standby stage (%s, %d layers on hand, no layers held) serving on %s",
                 cfg.model_dir.name, servicer.num_layers, address)
    else:
        identity = servicer.identity
        log.info("stage %d/%d (layers %d-%d, %s model, %d KV blocks, steps up to %d tokens "
                 "over %d sequences) serving on %s", cfg.stage_index, cfg.num_stages,
                 identity.layer_start, identity.layer_end - 1, identity.model_impl,
                 identity.num_kv_blocks, identity.max_num_batched_tokens,
                 identity.max_num_seqs, address)
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(address)
        os.replace(tmp, ready_file)
    rc = await _wait_for_stop(ranks, beats)
    health_srv.enter_graceful_shutdown()
    servicer.draining = True
    await server.stop(grace=5)
    servicer.close()
    for p in ranks:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    return rc


def _stop_ranks(ranks: list[subprocess.Popen[bytes]]) -> None:
    for p in ranks:
        p.kill()
        p.wait()


async def _wait_for_stop(ranks: list[subprocess.Popen[bytes]], beats: RankBeats) -> int:
    """Until SIGTERM/SIGINT (0), or a TP rank dying or hanging (the process exits with 1:
    the stage is down as a whole)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        dead = [p for p in ranks if p.poll() is not None]
        if dead:
            log.error("TP rank process %d exited with %s: taking the stage down",
                      dead[0].pid, dead[0].returncode)
            for p in ranks:
                p.kill()
            os._exit(1)  # the TP group is poisoned; the launcher restarts the stage whole
        if (hung := beats.hung()) is not None:
            log.error("TP rank process %d has not answered for %.1fs (stopped or wedged): "
                      "taking the stage down", *hung)
            for p in ranks:
                p.kill()  # a stopped process is killed too
            os._exit(1)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.5)
    return 0


def run_stage(cfg: StageConfig, ready_file: Path | None = None,
              tls: ServerTls | None = None, stage_token: str = "") -> int:
    logging.basicConfig(level=logging.INFO,
                        format=f"[stage {cfg.stage_index}] %(message)s", stream=sys.stderr)
    if setup_tracing("stagemesh-stage", cfg.otlp_traces_endpoint) is not None:
        log.info("tracing: OpenTelemetry spans over OTLP")
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass
    try:
        return asyncio.run(serve_stage(cfg, ready_file, tls, stage_token))
    except ListenError as e:
        log.error("%s", e)
        return 1
