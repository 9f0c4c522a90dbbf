"""The router process: the public gRPC API (health, reflection) and its front, in front of
an engine core that runs in a child process (`router.core.process`).

Start-up: the gRPC server serves health (NOT_SERVING) at once; the core is started and
brings the pipeline up; once it reports what the stages can do (`ServedInfo`), the API
serves. A core that cannot start (the stages never came up, or a flag exceeds a stage's
capacity) ends the router with one line saying why; a core that dies later ends it too.
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

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from foundation.api_keys import ApiKeys
from foundation.tls import ListenError, add_port
from foundation.tokenizer import ModelTokenizer
from protos.stagemesh.v1 import inference_pb2, inference_pb2_grpc
from router.auth import ApiKeyInterceptor
from router.config import RouterConfig
from router.core.channel import FrontEndpoint
from router.core.config import CoreConfig
from router.core.messages import ServedInfo
from router.core.process import run_core
from router.frontend import CoreStartError, Frontend
from router.outputs import FailureKind
from router.service import InferenceServicer

log = logging.getLogger("stagemesh.router")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CORE_EXIT_TIMEOUT_S = 15.0


def core_config(cfg: RouterConfig, input_address: str) -> CoreConfig:
    return CoreConfig(
        model_dir=str(cfg.model_dir), stage_addresses=cfg.stage_addresses,
        input_address=input_address, stage_tls=cfg.stage_tls, max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_queued_requests=cfg.max_queued_requests, max_queued_tokens=cfg.max_queued_tokens,
        enable_prefix_caching=cfg.enable_prefix_caching, startup_budget_s=cfg.startup_budget_s,
        recovery_budget_s=cfg.recovery_budget_s, step_timeout_s=cfg.step_timeout_s,
        run_ahead=cfg.run_ahead)


class RouterApp:
    """Composes the front, the servicers and the engine core; owns their lifetimes.

    Construct inside a running event loop.
    """

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.tokenizer = ModelTokenizer.from_dir(cfg.model_dir)
        self._dir = tempfile.mkdtemp(prefix="stagemesh-router-")
        self.core_cfg = core_config(cfg, f"ipc://{self._dir}/core")
        self.front = Frontend(0, FrontEndpoint(0, self.core_cfg.input_address,
                                               f"ipc://{self._dir}/front0"),
                              self.tokenizer, cfg.stream_interval)
        self.servicer = InferenceServicer(self.front, self.tokenizer, cfg.model_name)
        self.health = health.HealthServicer()
        interceptors = [ApiKeyInterceptor(ApiKeys(cfg.api_keys))] if cfg.api_keys else []
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", cfg.max_request_bytes),
            ("grpc.max_send_message_length", 64 << 20)])
        self._core_proc: subprocess.Popen[bytes] | None = None
        self._core_task: asyncio.Task[int] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.core_gone = asyncio.Event()

    async def start(self) -> str:
        """Serve health at once, start the core and wait until it reports the stages up.
        Returns the bound address.

        Raises ListenError (the port) or CoreStartError (the stages did not come up within
        the startup budget, or a flag exceeds a stage's capacity), having stopped what it
        started.
        """
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._set_health(live=True, ready=False)
        names = (inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name,
                 health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        port = add_port(self.server, self.cfg.host, self.cfg.port, self.cfg.tls)
        await self.server.start()
        address = f"{self.cfg.host}:{port}"
        log.info("router listening on %s; waiting for %d stage(s)", address,
                 len(self.cfg.stage_addresses))
        self._start_core()
        self._tasks = [asyncio.create_task(self.front.run(), name="front"),
                       asyncio.create_task(self._watch_core(), name="core-watch")]
        try:
            await self._wait_served()
        except BaseException:
            await self._stop_all()
            raise
        self._tasks.append(asyncio.create_task(self._watch_readiness()))
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

    def _set_health(self, live: bool, ready: bool) -> None:
        self.health.set("liveness", SERVING if live else NOT_SERVING)
        self.health.set("readiness", SERVING if ready else NOT_SERVING)
        self.health.set("", SERVING if ready else NOT_SERVING)

    async def _watch_readiness(self) -> None:
        last = None
        while True:
            ready = self.front.core_ready and not self.servicer.draining
            if ready != last:
                self._set_health(live=True, ready=ready)
                log.info("readiness: %s", "SERVING" if ready else "NOT_SERVING")
                last = ready
            await asyncio.sleep(0.1)

    async def drain_and_stop(self) -> None:
        """SIGTERM: NOT_SERVING at once, refuse new work, let in-flight requests finish,
        then stop the core (it drains the stages) and the server."""
        self.servicer.draining = True
        self._set_health(live=True, ready=False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.drain_timeout_s
        while self.front.requests and loop.time() < deadline and not self.core_gone.is_set():
            await asyncio.sleep(0.05)
        self.front.fail_all(FailureKind.UNAVAILABLE, "server stopping")
        await self._stop_all()

    async def _stop_all(self) -> None:
        self.front.shutdown_core()
        await self._wait_core_exit()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.server.stop(grace=1.0)
        self.front.endpoint.close()
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
    address = await app.start()
    if ready_file:
        with open(ready_file + ".tmp", "w") as f:
            f.write(address)
        os.replace(ready_file + ".tmp", ready_file)
    stopped = asyncio.create_task(stop.wait())
    gone = asyncio.create_task(app.core_gone.wait())
    await asyncio.wait({stopped, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not stop.is_set():
        log.error("the engine core exited; stopping the router")
        await app.drain_and_stop()
        return 1
    log.info("draining")
    await app.drain_and_stop()
    return 0


def run_router(cfg: RouterConfig, ready_file: str | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[router] %(message)s", stream=sys.stderr)
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
    except ListenError as e:
        log.error("%s", e)
        return 1
