"""`stagemesh serve`: the whole pipeline on one machine, as real processes.

Starts P stage processes (each spawns its own TP ranks), then the router, then the HTTP
gateway; waits until the router reports ready; prints the endpoints and one line per
process. A stage (or the gateway) that dies is restarted on the same port (the router
re-links and re-prefills), after a backoff that grows while it keeps dying soon after its
start, at most 5 times in 10 minutes: past that `serve` stops with a line naming it (a
process that cannot stay up is a fault to fix, not load). SIGINT/SIGTERM drains the router,
then stops everything; no process is left.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from foundation.cpus import usable_cores
from foundation.grpc_auth import STAGE_TOKEN_ENV
from foundation.model_config import ModelConfig
from foundation.modelstore import resolve_model
from foundation.ports import free_port, reserve
from stage_worker.partition import partition_layers
from stagemesh import cpu_policy
from stagemesh.placement import auto_layers
from stagemesh.supervised import supervisor_env

READY_TIMEOUT_S = 600.0


# Restarts of one child: at most RESTART_LIMIT within RESTART_WINDOW_S (then `serve` stops
# with a line saying so), each after a backoff that doubles from RESTART_BACKOFF_S up to
# RESTART_BACKOFF_MAX_S while the child keeps dying within RESTART_STABLE_S of its start.
RESTART_LIMIT = 5
RESTART_WINDOW_S = 600.0
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
RESTART_STABLE_S = 60.0


class RestartLimitError(RuntimeError):
    """A child died more often than the restart policy allows."""


@dataclass
class Child:
    """One supervised process: its role, command, ready file and address once ready."""

    role: str
    argv: list[str]
    ready_file: Path
    restart: bool
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""
    restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    metrics: str = ""  # its Prometheus endpoint, if it serves one
    started_at: float = 0.0
    restart_at: float | None = None  # a restart waiting out its backoff
    backoff_s: float = 0.0
    deaths: deque[float] = field(default_factory=deque)  # within the restart window

    def start(self) -> None:
        self.ready_file.unlink(missing_ok=True)
        self.started_at = time.monotonic()
        self.restart_at = None
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env,
                                                     **supervisor_env()},
                                     start_new_session=True)

    def schedule_restart(self, now: float) -> float:
        """Record a death at `now` and when to start again; returns the delay. Raises
        RestartLimitError past RESTART_LIMIT deaths within RESTART_WINDOW_S."""
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > RESTART_WINDOW_S:
            self.deaths.popleft()
        if len(self.deaths) > RESTART_LIMIT:
            assert self.proc is not None
            raise RestartLimitError(
                f"{self.role} exited {len(self.deaths)} times within "
                f"{RESTART_WINDOW_S / 60:.0f} minutes (last status {self.proc.returncode}); "
                f"not restarting it again: its output above says why it stops")
        stable = now - self.started_at >= RESTART_STABLE_S
        self.backoff_s = (RESTART_BACKOFF_S if stable or not self.backoff_s
                          else min(2 * self.backoff_s, RESTART_BACKOFF_MAX_S))
        self.restarts += 1
        self.restart_at = now + self.backoff_s
        return self.backoff_s

    def ready(self) -> bool:
        if self.ready_file.exists():
            self.address = self.ready_file.read_text().strip()
            return True
        return False


def _stage_devices(args: argparse.Namespace) -> list[str]:
    """Device per stage: one GPU group per stage when there are enough, else all share.
    A device this machine lacks ends `serve` with one line."""
    from kernels.platform import PLATFORM, DeviceUnavailableError, resolve_device

    try:
        device = resolve_device(args.device)
    except DeviceUnavailableError as e:
        raise SystemExit(f"stagemesh serve: --device {e}") from None
    if device.type == "cpu":
        return ["cpu"] * args.stages
    if PLATFORM.cuda_device_count >= args.stages * args.tp:
        return [f"cuda:{i * args.tp}" for i in range(args.stages)]
    return ["cuda:0"] * args.stages


def _stage_flags(args: argparse.Namespace, device: str, stages_on_device: int) -> list[str]:
    """The flags every stage gets from `serve`: the same step capacity as the router's
    (--max-num-batched-tokens, --max-num-seqs), the same --transport (what it offers),
    model implementation, pool and dtype; on a GPU, its share of the card's memory."""
    flags = ["--device", device, "--num-stages", str(args.stages), "--tp", str(args.tp),
             "--dtype", args.dtype,
             "--model-impl", args.model_impl,
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-num-seqs", str(args.max_num_seqs),
             "--transport", args.transport]
    if args.layers:
        flags += ["--layers", ",".join(map(str, args.layers))]
    if args.num_blocks:
        flags += ["--num-blocks", str(args.num_blocks)]
    if args.kv_cache_gb:
        flags += ["--kv-cache-gb", str(args.kv_cache_gb)]
    if args.enforce_eager:
        flags.append("--enforce-eager")
    if args.quantization != "none":
        flags += ["--quantization", args.quantization]
    if args.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.activation_compression != "none":
        flags += ["--activation-compression", args.activation_compression]
    if device.startswith("cuda"):  # stages sharing a GPU split its memory
        flags += ["--gpu-memory-utilization", f"{0.9 / stages_on_device:.3f}"]
    return flags


def _stage_env(args: argparse.Namespace, device: str) -> dict[str, str]:
    """The threads of a CPU stage's TP ranks: they compute at once and meet at a collective
    every layer, so each gets its share of the cores (as torchrun does), not all of them:
    tp ranks each spinning up a thread per core oversubscribe the host (decode ran 2.5x
    slower with --tp 2 on 2 cores). The cores are those serve may use (a container's CPU
    limit counts: `foundation.cpus`). An OMP_NUM_THREADS the user set is kept."""
    if device != "cpu" or args.tp == 1 or "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, usable_cores() // args.tp))}


def build_children(args: argparse.Namespace, workdir: Path,
                   api_keys: frozenset[str] = frozenset()) -> list[Child]:
    """`api_keys`: accepted by the router and the gateway (the gateway presents one)."""
    py = [sys.executable, "-m", "stagemesh"]
    model = str(resolve_model(args.model))
    devices = _stage_devices(args)
    if args.standby and args.tp != 1:
        raise SystemExit("stagemesh serve: --standby needs --tp 1 (a standby stage spawns no "
                         "TP ranks)")
    # Standby stages share the devices in turn; each counts in its device's memory split.
    standby_devices = [devices[j % len(devices)] for j in range(args.standby)]
    on_device = [*devices, *standby_devices].count
    if args.layers:  # refused here, before any process starts, not by each stage
        try:
            cfg = ModelConfig.from_dir(Path(model))
        except (KeyError, ValueError) as e:
            raise SystemExit(f"stagemesh serve: cannot read {model}/config.json to check "
                             f"--layers: {e!r}") from None
        try:
            if args.layers == "auto":
                layers = auto_layers(cfg, devices, {d: on_device(d) for d in devices},
                                     args.dtype)
                print(f"stagemesh serve: --layers auto: {','.join(map(str, layers))} "
                      f"(devices {', '.join(devices)})", flush=True)
                args = argparse.Namespace(**{**vars(args), "layers": layers})
            partition_layers(cfg.num_layers, args.stages, args.layers)
        except (ValueError, RuntimeError) as e:
            raise SystemExit(f"stagemesh serve: --layers: {e}") from None
    # The pairing secret of this pipeline: its stages serve only this router. In the
    # environment, never in argv; one per launch unless $STAGEMESH_STAGE_TOKEN names it.
    pairing = {STAGE_TOKEN_ENV: os.environ.get(STAGE_TOKEN_ENV) or secrets.token_urlsafe(32)}
    children = []
    stage_addresses = []
    # The router's and the gateway's own ports bind later, in their processes: the ports
    # picked for the other children must not be one of them.
    reserve(args.port, args.gateway_port)

    def metrics(host: str) -> tuple[list[str], str]:
        """The flag and URL of a child's metrics endpoint on a free port (none with
        --no-metrics). A restarted child keeps its port."""
        if args.no_metrics:
            return [], ""
        port = free_port()
        return ["--metrics-port", str(port)], f"http://{host}:{port}/metrics"

    traces = ([f"--otlp-traces-endpoint={args.otlp_traces_endpoint}"]
              if args.otlp_traces_endpoint else [])
    for i, device in enumerate(devices):
        port = free_port()
        stage_addresses.append(f"127.0.0.1:{port}")
        flags, url = metrics("127.0.0.1")
        flags += traces
        argv = [*py, "stage", "--model", model, "--stage-index", str(i), "--port", str(port),
                "--ready-file", str(workdir / f"stage{i}"), *flags,
                *_stage_flags(args, device, on_device(device))]
        children.append(Child(f"stage {i}", argv, workdir / f"stage{i}", restart=True,
                              env={**pairing, **_stage_env(args, device)}, metrics=url))
    standby_addresses = []
    for j, device in enumerate(standby_devices):
        port = free_port()
        standby_addresses.append(f"127.0.0.1:{port}")
        flags, url = metrics("127.0.0.1")  # served once it takes a stage's place
        flags += traces
        argv = [*py, "stage", "--model", model, "--standby", "--port", str(port),
                "--ready-file", str(workdir / f"standby{j}"), *flags,
                *_stage_flags(args, device, on_device(device))]
        children.append(Child(f"standby {j}", argv, workdir / f"standby{j}", restart=True,
                              env=pairing, metrics=url))
    router = [*py, "router", "--model", model, "--stages", ",".join(stage_addresses),
              "--host", args.host, "--port", str(args.port), "--ready-file",
              str(workdir / "router"), "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--max-model-len", str(args.max_model_len),
              "--max-queued-requests", str(args.max_queued_requests),
              "--max-queued-tokens", str(args.max_queued_tokens),
              "--startup-budget", str(args.startup_budget),
              "--recovery-budget", str(args.recovery_budget),
              "--step-timeout", str(args.step_timeout),
              "--drain-timeout", str(args.drain_timeout),
              "--stream-interval", str(args.stream_interval),
              "--engine-core", args.engine_core,
              "--run-ahead-depth", str(args.run_ahead_depth),
              "--run-ahead-budget-ms", str(args.run_ahead_budget_ms),
              "--micro-batches", str(args.micro_batches),
              "--trace-step-interval", str(args.trace_step_interval),
              "--api-processes", str(args.api_processes),
              "--transport", args.transport,
              "--standby-grace", str(args.standby_grace),
              "--tool-call-parser", args.tool_call_parser]
    if standby_addresses:
        router += ["--standby-stages", ",".join(standby_addresses)]
    router_metrics, router_metrics_url = metrics(args.host)
    router += [*router_metrics, *traces]
    if args.model_name:
        router += ["--model-name", args.model_name]
    if args.no_prefix_caching:
        router.append("--no-prefix-caching")
    if args.no_run_ahead:
        router.append("--no-run-ahead")
    if args.no_audit_log:
        router.append("--no-audit-log")
    if args.audit_log_content:
        router.append("--audit-log-content")
    # API keys travel in the environment, not in argv (which `ps` shows): the router and the
    # gateway accept the same keys; the gateway presents one of them to the router.
    keys = sorted(api_keys)
    key_env = {"STAGEMESH_API_KEYS": ",".join(keys)} if keys else {}
    children.append(Child("router", router, workdir / "router", restart=False,
                          env={**key_env, **pairing}, metrics=router_metrics_url))
    if args.gateway_port:
        gateway = [*py, "gateway", "--router", f"{args.host}:{args.port}", "--host", args.host,
                   "--port", str(args.gateway_port), "--ready-file", str(workdir / "gateway"),
                   "--tokenizer", model, "--router-connections", str(args.api_processes),
                   "--drain-timeout", str(args.drain_timeout),
                   *traces]
        gateway_env = {**key_env, "STAGEMESH_ROUTER_API_KEY": keys[0]} if keys else {}
        children.append(Child("gateway", gateway, workdir / "gateway", restart=True,
                              env=gateway_env,
                              metrics=f"http://{args.host}:{args.gateway_port}/metrics"))
    return children


def _wait_ready(children: list[Child], deadline: float, stop: dict[str, int]) -> None:
    """Until every child is ready or a signal came (`stop`). Raises RuntimeError when a
    child exits first or the deadline passes."""
    while not all(c.ready() for c in children) and not stop["signal"]:
        for c in children:
            assert c.proc is not None
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.role} exited with status {c.proc.returncode} before it "
                                   "was ready (see its log above)")
        if time.monotonic() > deadline:
            late = ", ".join(c.role for c in children if not c.ready())
            raise RuntimeError(f"not ready within {READY_TIMEOUT_S:.0f}s: {late}")
        time.sleep(0.1)


# What a router needs beyond its drain timeout to stop its fronts, core and stages' links.
STOP_MARGIN_S = 10.0


def _stop(children: list[Child], timeout_s: float) -> None:
    """Router first (it drains), then the rest; kill whatever outlives the timeout."""
    for group in ([c for c in children if c.role == "router"],
                  [c for c in children if c.role != "router"]):
        for c in group:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in group:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()


def launch(args: argparse.Namespace, api_keys: frozenset[str] = frozenset()) -> int:
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    set_cpu_policy(args)
    with tempfile.TemporaryDirectory(prefix="stagemesh-") as tmp:
        children = build_children(args, Path(tmp), api_keys)
        try:  # whatever ends serve (an error, a signal, a closed stdout), its children stop
            try:
                for c in children:
                    c.start()
                _wait_ready(children, time.monotonic() + READY_TIMEOUT_S, stop)
                if not stop["signal"]:
                    _print_endpoints(children, args)
                    _supervise(children, stop)
            except RuntimeError as e:
                print(f"stagemesh serve: {e}", file=sys.stderr, flush=True)
                return 1
        finally:
            _stop(children, args.drain_timeout + STOP_MARGIN_S)
    print("stagemesh serve: stopped", file=sys.stderr)
    return 0


def set_cpu_policy(args: argparse.Namespace) -> cpu_policy.CpuPolicy | None:
    """Set serve's scheduling policy, before it starts any child: every child, and every
    thread in it, inherits it (`stagemesh.cpu_policy`). `auto` that comes out normal leaves
    the policy serve was started with. Returns the policy set, None where none was."""
    if not cpu_policy.supported():  # batch was refused at the command line
        return None
    core = 1 if args.engine_core == "process" else 0  # a task of front 0: no process
    busy = args.stages * args.tp + core + args.api_processes  # stage ranks, core, fronts
    cores = usable_cores()
    policy = cpu_policy.choose(args.cpu_policy, busy, cores)
    if policy == "normal" and args.cpu_policy == "auto":
        return None
    cpu_policy.apply(policy)
    if args.cpu_policy == "auto":
        print(f"stagemesh serve: --cpu-policy auto: {policy} ({busy} processes work on every "
              f"step, {cores} usable cores)", flush=True)
    return policy


def _print_endpoints(children: list[Child], args: argparse.Namespace) -> None:
    """Every child's pid, address and metrics endpoint, then the ready line, in one write:
    whoever waits for the ready line (`local_mesh.Mesh`, a reader) has every endpoint."""
    lines = [f"  {c.role:<9} pid {c.proc.pid if c.proc else '-':<7} {c.address:<21}"
             + (f"  metrics {c.metrics}" if c.metrics else "") for c in children]
    router = next(c for c in children if c.role == "router")
    http = f", HTTP http://{args.host}:{args.gateway_port}/v1" if args.gateway_port else ""
    lines.append(f"stagemesh ready: gRPC {router.address}{http}")
    print("\n".join(lines), flush=True)


def _supervise(children: list[Child], stop: dict[str, int]) -> None:
    """Until a signal: restart stages (same port) and the gateway if they die, with backoff
    and a cap (`Child.schedule_restart`). Raises RuntimeError when the router dies or a
    child hits the cap."""
    while not stop["signal"]:
        now = time.monotonic()
        for c in children:
            assert c.proc is not None
            if c.restart_at is not None:
                if now >= c.restart_at:
                    c.start()
                    assert c.proc is not None
                    print(f"stagemesh serve: {c.role} restarted, pid {c.proc.pid}",
                          file=sys.stderr, flush=True)
                continue
            if c.proc.poll() is None:
                continue
            if not c.restart:
                raise RuntimeError(f"{c.role} exited with status {c.proc.returncode}")
            delay = c.schedule_restart(now)
            print(f"stagemesh serve: {c.role} exited ({c.proc.returncode}); restarting in "
                  f"{delay:.1f}s (restart {c.restarts})", file=sys.stderr, flush=True)
        time.sleep(0.2)
