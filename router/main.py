"""The router process: front 0 (the public gRPC API with health and reflection, and its
`Frontend`), the front processes that `--api-processes N` adds (fronts 1..N-1,
`router.fronts`), and the engine core in a child process (`router.core.process`) that every
front talks to.

Start-up: front 0 serves health (NOT_SERVING) at once; the core is started and brings the
pipeline up while the front processes start and bind the same port; once the core reports
what the stages can do (`ServedInfo`) and every front serves, the router is up. A core that
cannot start (the stages never came up, or a flag exceeds a stage's capacity) ends the
router with one line saying why; a core that dies later ends it too, and so do front
processes that keep dying (`router.fronts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

from foundation.aio import unless_set
from foundation.metrics import (
    MetricsServer,
    multiprocess_registry,
    remove_multiprocess_dir,
    serve_metrics,
)
from foundation.tls import ListenError
from foundation.tokenizer import ModelTokenizer
from foundation.tracing import setup_tracing
from router.config import RouterConfig
from router.core.config import CoreConfig
from router.core.messages import ServedInfo
from router.core.process import run_core
from router.front_server import FrontConfig, FrontServer
from router.frontend import CoreStartError
from router.fronts import FrontProcesses, FrontStartError

log = logging.getLogger("stagemesh.router")

CORE_EXIT_TIMEOUT_S = 15.0
FRONT_EXIT_MARGIN_S = 5.0  # beyond the drain timeout, for a front process to exit


def core_config(cfg: RouterConfig, input_address: str, metrics_dir: str = "") -> CoreConfig:
    return CoreConfig(
        model_dir=str(cfg.model_dir), stage_addresses=cfg.stage_addresses,
        input_address=input_address, stage_tls=cfg.stage_tls, max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_queued_requests=cfg.max_queued_requests, max_queued_tokens=cfg.max_queued_tokens,
        enable_prefix_caching=cfg.enable_prefix_caching, startup_budget_s=cfg.startup_budget_s,
        recovery_budget_s=cfg.recovery_budget_s, step_timeout_s=cfg.step_timeout_s,
        run_ahead=cfg.run_ahead, run_ahead_depth=cfg.run_ahead_depth,
        run_ahead_budget_ms=cfg.run_ahead_budget_ms, micro_batches=cfg.micro_batches,
        stage_token=cfg.stage_token, transport=cfg.transport,
        standby_stages=cfg.standby_stages, standby_grace_s=cfg.standby_grace_s,
        metrics_dir=metrics_dir, otlp_traces_endpoint=cfg.otlp_traces_endpoint,
        trace_step_interval=cfg.trace_step_interval)


class RouterApp:
    """Composes front 0, the front processes and the engine core; owns their lifetimes.

    Construct inside a running event loop.
    """

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.tokenizer = ModelTokenizer.from_dir(cfg.model_dir)
        self._dir = tempfile.mkdtemp(prefix="stagemesh-router-")
        # Metrics: every process of the router records into one directory (its own, in
        # this run's directory), summed at each scrape of `metrics_port`.
        self.metrics_dir = ""
        if cfg.metrics_port is not None:
            self.metrics_dir = os.path.join(self._dir, "metrics")
            os.mkdir(self.metrics_dir)
        self.metrics_server: MetricsServer | None = None
        self.core_cfg = core_config(cfg, os.path.join(self._dir, "core.sock"),
                                    self.metrics_dir)
        self.port = cfg.port  # the bound one once started
        self.server = FrontServer(self._front_config(0), self.tokenizer)
        self.front = self.server.front
        self.servicer = self.server.servicer
        self.fronts = FrontProcesses(cfg.api_processes - 1, self._front_config,
                                     self.front.report_front_gone)
        self._core_proc: subprocess.Popen[bytes] | None = None
        self._core_task: asyncio.Task[int] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.core_gone = asyncio.Event()
        self._stopped = False

    def _front_config(self, front_id: int) -> FrontConfig:
        return FrontConfig.of_router(self.cfg, front_id, self.core_cfg.input_address,
                                     self.port, self.metrics_dir)

    async def start(self) -> str:
        """Serve health at once, start the core and the front processes, and wait until the
        core reports the stages up and every front serves. Returns the bound address.

        Raises ListenError (the port), CoreStartError (the stages did not come up within the
        startup budget, or a flag exceeds a stage's capacity) or FrontStartError, having
        stopped what it started.
        """
        self.port = await self.server.start()  # port 0: the front processes bind this one
        address = f"{self.cfg.host}:{self.port}"
        if self.cfg.metrics_port is not None:
            try:
                self.metrics_server = serve_metrics(multiprocess_registry(self.metrics_dir),
                                                    self.cfg.metrics_port, self.cfg.host)
            except OSError as e:
                await self.server.stop()
                raise ListenError(f"--metrics-port: cannot listen on {self.cfg.host}:"
                                  f"{self.cfg.metrics_port}: {e}") from None
            log.info("metrics on http://%s:%d/metrics", self.cfg.host,
                     self.metrics_server.port)
        log.info("router listening on %s; waiting for %d stage(s)", address,
                 len(self.cfg.stage_addresses))
        self._start_core()
        self._tasks = [asyncio.create_task(self._watch_core(), name="core-watch")]
        fronts = asyncio.create_task(self.fronts.start(), name="front-processes")
        try:
            await self._wait_served()
            await fronts
        except BaseException:
            fronts.cancel()
            await asyncio.gather(fronts, return_exceptions=True)
            await self._stop_all()
            raise
        self.server.update_readiness()  # SERVING before anyone hears the router is up
        if self.fronts.count:
            log.info("%d front process(es) serve %s too (--api-processes %d)",
                     self.fronts.count, address, self.cfg.api_processes)
        return address

    def _start_core(self) -> None:
        if self.cfg.engine_core == "task":
            self._core_task = asyncio.create_task(run_core(self.core_cfg), name="core")
            return
        # The config goes through stdin, not argv: it may hold the stage TLS client key,
        # and a command line is readable by anyone on the host (`ps`).
        self._core_proc = subprocess.Popen([sys.executable, "-m", "router.core.process"],
                                           stdin=subprocess.PIPE)
        assert self._core_proc.stdin is not None
        self._core_proc.stdin.write(self.core_cfg.to_json().encode())
        self._core_proc.stdin.close()

    async def _wait_served(self) -> ServedInfo:
        """The core's first report, or CoreStartError if it exits without one."""
        gone = asyncio.create_task(self.core_gone.wait())
        waits: list[asyncio.Future[Any]] = [self.front.served, gone]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not self.front.served.done():  # its last words may still be on their way
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.front.served), 2.0)
        if self.front.served.done():
            return self.front.served.result()  # raises the core's CoreStartError
        raise CoreStartError("pipeline", "the engine core exited while starting")

    async def _watch_core(self) -> None:
        """Set `core_gone` when the core ends (its process, or its task)."""
        if self._core_task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(self._core_task)
        else:
            assert self._core_proc is not None
            while self._core_proc.poll() is None:
                await asyncio.sleep(0.2)
        self.core_gone.set()

    async def drain_and_stop(self) -> None:
        """SIGTERM: every front NOT_SERVING at once and refusing new work; in-flight
        requests get the drain timeout to finish; then the front processes exit, the core
        stops (it drains the stages) and so does front 0's server. Once only: a later call
        returns at once."""
        if self._stopped:
            return
        self.server.start_draining()
        timeout = self.cfg.drain_timeout_s
        fronts = asyncio.create_task(self.fronts.stop(timeout + FRONT_EXIT_MARGIN_S,
                                                      self.core_gone.is_set))
        await self.server.drain(asyncio.get_running_loop().time() + timeout,
                                self.core_gone.is_set)
        await fronts
        await self._stop_all()

    async def _stop_all(self) -> None:
        self._stopped = True
        await self.fronts.stop(FRONT_EXIT_MARGIN_S)  # at once when they already exited
        self.front.shutdown_core()
        await self._wait_core_exit()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.server.stop()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.metrics_dir:  # and this process records into a directory no more
            remove_multiprocess_dir(self.metrics_dir)
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _wait_core_exit(self) -> None:
        if self._core_task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._core_task, CORE_EXIT_TIMEOUT_S)
            return
        proc = self._core_proc
        if proc is None:
            return
        try:
            await asyncio.to_thread(proc.wait, CORE_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("the engine core did not exit within %.0fs; killing it",
                      CORE_EXIT_TIMEOUT_S)
            proc.kill()
            await asyncio.to_thread(proc.wait)


async def serve_router(cfg: RouterConfig, ready_file: str | None = None) -> int:
    app = RouterApp(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    address = await unless_set(app.start(), stop)  # ListenError, CoreStartError, ...
    if address is None:  # a signal while the stages are awaited: `start` stopped its parts
        log.info("stopping before the pipeline came up")
        return 0
    if ready_file:
        with open(ready_file + ".tmp", "w") as f:
            f.write(address)
        os.replace(ready_file + ".tmp", ready_file)
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(app.core_gone.wait()),
             asyncio.create_task(app.fronts.failed.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    if stop.is_set():
        log.info("draining")
        await app.drain_and_stop()
        return 0
    if app.core_gone.is_set():
        log.error("the engine core exited; stopping the router")
    else:
        log.error("%s; stopping the router", app.fronts.error)
    await app.drain_and_stop()
    return 1


def run_router(cfg: RouterConfig, ready_file: str | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[router] %(message)s", stream=sys.stderr)
    if setup_tracing("stagemesh-router", cfg.otlp_traces_endpoint) is not None:
        log.info("tracing: OpenTelemetry spans over OTLP")
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    try:
        return asyncio.run(serve_router(cfg, ready_file))
    except CoreStartError as e:
        if e.kind == "pipeline":
            log.error("%s. Check that every stage in --stages is running and reachable, in "
                      "pipeline order, with matching TLS settings; --startup-budget sets the "
                      "wait.", e)
        else:
            log.error("%s", e)
        return 1
    except (ListenError, FrontStartError) as e:
        log.error("%s", e)
        return 1
